"""kvmesh installs under one import namespace: the repository's folders ``shared``, ``services``,
``kernels``, ``loadgen`` and ``sim`` become ``kvmesh.shared`` ... and nothing of those names lands at the top
of site-packages (``kernels`` is also Hugging Face's package). Checked on a wheel built here, not
only on the editable install the suite runs from."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from kvmesh.kernels import cpu_ops

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _folders_with_init() -> set[str]:
    """Every package the repository's folders hold, under its installed name."""
    found = set()
    for name, folder in PYPROJECT["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    return found


def test_every_package_folder_is_listed_for_the_wheel():
    listed = set(PYPROJECT["packages"])
    assert _folders_with_init() <= listed
    for package in listed - _folders_with_init():  # the rest: folders of data, no code
        name = max((n for n in PYPROJECT["package-dir"] if package.startswith(n + ".")), key=len)
        folder = ROOT / PYPROJECT["package-dir"][name] / package[len(name) + 1 :].replace(".", "/")
        assert folder.is_dir() and not list(folder.glob("*.py")), package


def test_every_folder_with_files_is_listed_so_the_install_is_quiet():
    # a folder of data (no __init__.py) missing from the list is what setuptools warns "Package
    # would be ignored" about on every `pip install -e .` (issue 45: a quiet install)
    missing = []
    for name, folder in PYPROJECT["package-dir"].items():
        for path in [ROOT / folder, *(ROOT / folder).rglob("*")]:
            if not path.is_dir() or "__pycache__" in path.parts:
                continue
            if any(p.is_file() and not p.name.startswith(".") for p in path.iterdir()):
                package = ".".join([name, *path.relative_to(ROOT / folder).parts])
                missing += [] if package in PYPROJECT["packages"] else [package]
    assert missing == [], "add these to [tool.setuptools] packages in pyproject.toml"


def test_nothing_under_shared_imports_the_services_or_the_cli():
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "shared").rglob("*.py")
        if any(
            f"{verb} kvmesh.{pkg}" in path.read_text()
            for verb in ("from", "import")
            for pkg in ("services", "cli", "commands", "loadgen", "sim")
        )
    ]
    assert offenders == []


def _pip(command: str, *args: str) -> None:
    """``python -m pip COMMAND -q ARGS`` with this interpreter; raises when pip fails."""
    subprocess.run(
        [sys.executable, "-m", "pip", command, "-q", *args],
        check=True,
        capture_output=True,
        timeout=240,
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT))
    (built,) = out.glob("kvmesh-*.whl")
    return built


def test_wheel_holds_only_the_kvmesh_namespace_and_the_c_kernels(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"kvmesh"}
    # every file the C kernels' build reads (kernels/cpu_ops.py compiles them on first use)
    assert {f"kvmesh/kernels/{p.name}" for p in (*cpu_ops.SOURCES, *cpu_ops.HEADERS)} <= set(names)
    assert "kvmesh/shared/bus/messages/codec.py" in names and "kvmesh/cli.py" in names


def test_wheel_imports_and_runs_its_command_outside_the_repository(wheel, tmp_path):
    target = tmp_path / "site"
    _pip("install", "--no-deps", "--target", str(target), str(wheel))
    assert not any(
        (target / top).exists() for top in ("shared", "services", "kernels", "loadgen", "sim")
    )
    probe = (
        "import kvmesh.shared.bus.messages.codec, kvmesh.services.router, kvmesh.kernels.cpu_ops, kvmesh.cli;"
        "print(kvmesh.shared.bus.messages.codec.__file__);"
        "kvmesh.cli.build_parser()"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,  # not the repository: its folders must not be what is imported
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().startswith(str(target))
    help_run = subprocess.run(
        [sys.executable, "-m", "kvmesh", "--help"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert help_run.returncode == 0 and "usage: kvmesh" in help_run.stdout, help_run.stderr
