"""The Docker host under ``make compose-test`` (scripts/compose_test.py): the tools, the daemon,
the offline base image and the wheelhouse, each made only when missing.

- Tools: ``docker``, ``dockerd``, a compose (v2's ``docker compose`` or v1's ``docker-compose``)
  and ``debootstrap``. Missing ones are installed with apt (Debian's docker.io, docker-compose,
  debootstrap) when this is root with apt-get; otherwise the error says what to install.
- The daemon: used as it is when ``docker info`` answers; else a ``dockerd`` is started here and
  stopped again when the test ends (``docker_daemon``), so the host is left as it was found.
- The base image ``kvmesh-base:bookworm``: ``debootstrap --variant=minbase`` of Debian bookworm
  from the mirror apt uses, with Python 3.11, venv and gcc, imported with ``docker import``. No
  registry is needed, so it is the base of the air-gapped build (docs/deploy.md). Made once.
- The wheelhouse: every dependency of the project as a wheel, at the versions of this checkout's
  ``.venv`` (pip freeze as constraints), torch's CPU wheel included; the image installs from it
  with ``--no-index``. Made again only when the requirements or the constraints change.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE_IMAGE = "kvmesh-base:bookworm"
SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "gcc", "libc6-dev", "ca-certificates")
APT_PACKAGES = {"docker": "docker.io", "dockerd": "docker.io", "compose": "docker-compose"}
APT_PACKAGES["debootstrap"] = "debootstrap"
DAEMON_START_TIMEOUT_S = 90.0
# `docker import` makes an image with no environment: set what a Dockerfile's ENV PATH extends.
IMPORT_CHANGES = [
    "--change",
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "--change",
    "ENV LANG=C.UTF-8",
]


class HostError(RuntimeError):
    """The host cannot run the stack; the message says what to do."""


def log(message: str) -> None:
    print(f"compose-test: {message}", file=sys.stderr, flush=True)


def run(argv: list[str], timeout_s: float, **kwargs) -> subprocess.CompletedProcess:
    """Run ``argv``; a non-zero exit raises HostError with the command and its output's tail."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, **kwargs)
    except subprocess.TimeoutExpired:
        raise HostError(f"{' '.join(argv)}: still running after {timeout_s:g} s") from None
    except FileNotFoundError:
        raise HostError(f"{argv[0]}: not found") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise HostError(f"{' '.join(argv)} exited {proc.returncode}:\n{tail}")
    return proc


def succeeds(argv: list[str], timeout_s: float = 30.0) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=timeout_s).returncode == 0
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False


# --- tools -------------------------------------------------------------------------------------


def compose_command() -> list[str] | None:
    """$KVMESH_COMPOSE (a command line, e.g. a compose v2 binary) when set; else compose v2 (the
    docker CLI plugin) where there is one, else v1's ``docker-compose``."""
    if os.environ.get("KVMESH_COMPOSE"):
        return os.environ["KVMESH_COMPOSE"].split()
    if succeeds(["docker", "compose", "version"]):
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def missing_packages() -> list[str]:
    """The apt packages that would bring the tools this host lacks."""
    missing = [t for t in ("docker", "dockerd", "debootstrap") if shutil.which(t) is None]
    if compose_command() is None:
        missing.append("compose")
    return sorted({APT_PACKAGES[t] for t in missing})


def ensure_tools() -> None:
    packages = missing_packages()
    if not packages:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise HostError(
            f"missing {', '.join(packages)}: install them (Debian: apt-get install "
            f"{' '.join(packages)}), or run as root on a host with apt-get"
        )
    log(f"installing {' '.join(packages)} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-q"], 600, env=env)
    run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages], 900, env=env)


# --- the daemon --------------------------------------------------------------------------------


def daemon_answers() -> bool:
    return succeeds(["docker", "info"], timeout_s=20)


@contextlib.contextmanager
def docker_daemon(log_path: Path) -> Iterator[bool]:
    """A Docker daemon for the block: the running one (yields False), or a ``dockerd`` started
    here (yields True) and stopped on exit (SIGTERM; it stops the containerd it started)."""
    if daemon_answers():
        yield False
        return
    if os.geteuid() != 0:
        raise HostError("no Docker daemon answers, and only root can start one: start dockerd")
    log(f"starting dockerd (log: {log_path})")
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            ["dockerd"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
        while not daemon_answers():
            if proc.poll() is not None:
                raise HostError(f"dockerd exited {proc.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                raise HostError(f"dockerd did not answer within {DAEMON_START_TIMEOUT_S:g} s")
            time.sleep(0.5)
        yield True
    finally:
        log("stopping the dockerd started here")
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- the base image ----------------------------------------------------------------------------


def debian_mirror(sources: dict[str, str]) -> str:
    """The first Debian archive (not security) that apt uses for ``SUITE``, from the text of
    sources.list files (one-line ``deb URI SUITE ...``) and deb822 ``.sources`` files."""
    for name, text in sources.items():
        if name.endswith(".sources"):
            for stanza in re.split(r"\n\s*\n", text):
                fields = dict(re.findall(r"^([A-Za-z-]+):\s*(.*)$", stanza, re.M))
                uris, suites = fields.get("URIs", "").split(), fields.get("Suites", "").split()
                if "deb" in fields.get("Types", "").split() and SUITE in suites and uris:
                    return uris[0]
        else:
            for line in text.splitlines():
                parts = line.split("#", 1)[0].split()
                options = 1 if len(parts) > 1 and parts[1].startswith("[") else 0
                if len(parts) > 2 + options and parts[0] == "deb" and parts[2 + options] == SUITE:
                    return parts[1 + options]
    raise HostError(f"no Debian {SUITE} archive in apt's sources: pass KVMESH_DEBIAN_MIRROR")


def apt_sources() -> dict[str, str]:
    paths = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    return {str(p): p.read_text() for p in paths if p.is_file()}


def image_exists(name: str) -> bool:
    return succeeds(["docker", "image", "inspect", name])


def ensure_base_image() -> bool:
    """``BASE_IMAGE`` from debootstrap, unless the daemon has it. Returns whether it was made."""
    if image_exists(BASE_IMAGE):
        return False
    mirror = os.environ.get("KVMESH_DEBIAN_MIRROR") or debian_mirror(apt_sources())
    log(f"debootstrap {SUITE} from {mirror} into {BASE_IMAGE} (a few minutes, once)")
    with tempfile.TemporaryDirectory(prefix="kvmesh-base-") as tmp:
        target = Path(tmp) / "root"
        run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                SUITE,
                str(target),
                mirror,
            ],
            1200,
        )
        shutil.rmtree(target / "var/cache/apt/archives", ignore_errors=True)
        (target / "var/cache/apt/archives/partial").mkdir(parents=True)
        tar = subprocess.Popen(["tar", "-C", str(target), "-c", "."], stdout=subprocess.PIPE)
        try:
            run(["docker", "import", *IMPORT_CHANGES, "-", BASE_IMAGE], 600, stdin=tar.stdout)
        finally:
            tar.stdout.close()
            if tar.wait() != 0:
                raise HostError(f"tar of {target} exited {tar.returncode}")
    return True


# --- the wheelhouse ----------------------------------------------------------------------------


def requirements(pyproject: dict) -> list[str]:
    """What the image installs before the project: its dependencies and its build backend."""
    return [*pyproject["project"]["dependencies"], *pyproject["build-system"]["requires"]]


def constraints(freeze: str) -> list[str]:
    """``pip freeze`` lines usable as constraints: pinned names (not editables, not URLs)."""
    return [
        line
        for line in freeze.splitlines()
        if re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*==\S+$", line.strip())
    ]


def ensure_wheelhouse(directory: Path, pip: Path) -> bool:
    """Every requirement as a wheel in ``directory``, at ``pip``'s environment's versions.
    Returns whether it was (re)made."""
    reqs = requirements(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    pins = constraints(run([str(pip), "freeze", "--all"], 120).stdout)
    stamp = hashlib.sha256("\n".join([*reqs, "--", *pins]).encode()).hexdigest()
    stamp_file = directory / ".stamp"
    if stamp_file.is_file() and stamp_file.read_text() == stamp:
        return False
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    log(f"building the wheelhouse in {directory}")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "constraints.txt").write_text("\n".join(pins) + "\n")
        (Path(tmp) / "requirements.txt").write_text("\n".join(reqs) + "\n")
        run(
            [
                str(pip),
                "wheel",
                "--quiet",
                "--wheel-dir",
                str(directory),
                "-c",
                f"{tmp}/constraints.txt",
                "-r",
                f"{tmp}/requirements.txt",
            ],
            1800,
        )
    stamp_file.write_text(stamp)
    return True


def main(argv: list[str] | None = None) -> int:
    """``compose_host.py wheelhouse [DIR] [--pip PIP]``: the wheelhouse for an air-gapped build
    (on a connected host); ``compose_host.py base-image``: kvmesh-base:bookworm (on the Docker
    host, from its Debian mirror). docs/deploy.md."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    sub = p.add_subparsers(dest="action", required=True)
    wheels = sub.add_parser("wheelhouse", help="every dependency as a wheel, in DIR")
    wheels.add_argument("dir", nargs="?", type=Path, default=ROOT / "wheelhouse")
    wheels.add_argument("--pip", type=Path, default=ROOT / ".venv" / "bin" / "pip")
    sub.add_parser("base-image", help=f"{BASE_IMAGE} with debootstrap, unless Docker has it")
    args = p.parse_args(argv)
    try:
        if args.action == "wheelhouse":
            made = ensure_wheelhouse(args.dir.resolve(), args.pip)
            log(f"wheelhouse {args.dir}: {'made' if made else 'up to date'}")
        else:
            made = ensure_base_image()
            log(f"{BASE_IMAGE}: {'made' if made else 'already there'}")
    except HostError as exc:
        log(str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
