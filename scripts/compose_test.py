#!/usr/bin/env python3
"""``make compose-test``: docker-compose.yml run for real, on one host, with no image registry.

1. The host (compose_host.py): Docker, compose and debootstrap installed with apt when missing
   (root with apt only), a dockerd started when none answers (stopped again at the end), the
   offline base image kvmesh-base:bookworm made once with debootstrap, the wheelhouse made
   from this checkout's .venv.
2. The images, with no registry and no network in the kvmesh build: kvmesh:latest (Dockerfile:
   BASE=kvmesh-base:bookworm, WHEELHOUSE=wheelhouse) and kvmesh-prometheus:latest.
3. ``up --scale prefill=2 --scale decode=2`` of a project of its own (free host ports, fresh
   NATS passwords, the mesh's auth config), on ``--model`` (default: kvmesh up's,
   smollm2-135m-instruct from kvmesh's cache; a checkpoint directory; or kvmesh-tiny), mounted
   read-only, then the checks (compose_checks.py): completions equal to
   ``kvmesh generate``'s, every replica in ``kvmesh admin status``, every Prometheus target up,
   a decode container killed under load, ``down -v`` leaving nothing.

Prints one line per check (PASS/FAIL and what was seen) and the time of each step; exits 0 only
when every check passed. ``--if-possible``: a host that cannot run Docker is a skip (exit 0,
the reason printed), not a failure. Logs of every container go to --out on a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import compose_checks as checks
from compose_host import (
    BASE_IMAGE,
    ROOT,
    HostError,
    compose_command,
    docker_daemon,
    ensure_base_image,
    ensure_tools,
    ensure_wheelhouse,
    log,
    run,
)
from compose_stack import Stack, StackSettings, log_step

from kvmesh.commands.up_model import DEFAULT_MODEL

WHEELHOUSE = "wheelhouse"  # in the build context: the checkout's root
BUILD_TIMEOUT_S = 1800


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"what kvmesh up serves by default ({DEFAULT_MODEL}: fetched and imported into "
        "kvmesh's cache once), another fetchable model or .gguf file, a Hugging Face checkpoint "
        "directory on this host, or kvmesh-tiny; the checkpoint is mounted read-only in every "
        "container and kvmesh generate reads the same files",
    )
    p.add_argument("--out", type=Path, help="where logs go (default: a new temporary folder)")
    p.add_argument(
        "--if-possible",
        action="store_true",
        help="skip (exit 0, reason printed) where this host cannot run Docker",
    )
    return p.parse_args(argv)


def stack_settings(model: str) -> StackSettings:
    """The model as the containers see it: kvmesh-tiny, or /models/<dir> with the directory's
    parent mounted at /models; the mesh is named after it as ``kvmesh up`` names it."""
    from kvmesh.shared.config.subjects import mesh_from_model

    project = f"kvmeshtest{os.getpid()}"
    if model == "kvmesh-tiny":
        return StackSettings(project, model, ROOT / "deploy" / "models", model, BASE_IMAGE)
    from kvmesh.shared.model.fetch import FetchError
    from kvmesh.shared.model.gguf_file import GGUFError
    from kvmesh.shared.model.model_ref import ModelRefError, resolve_model

    try:  # a fetchable name or a .gguf file: its imported checkpoint in kvmesh's cache
        path = Path(resolve_model(model, progress=log).path).resolve()
    except (FetchError, GGUFError, ModelRefError) as exc:
        raise HostError(str(exc)) from None
    if not (path / "config.json").is_file():
        raise HostError(f"--model {model}: not kvmesh-tiny nor a checkpoint dir (no config.json)")
    unreadable = [f.name for f in path.iterdir() if f.is_file() and not f.stat().st_mode & 0o004]
    if path.stat().st_mode & 0o005 != 0o005:
        unreadable.append(f"{path.name}/")
    if unreadable:
        raise HostError(
            f"--model {model}: {', '.join(sorted(unreadable))} not readable by other users, and "
            f"the containers run as uid 10001: chmod -R a+rX {path}"
        )
    return StackSettings(
        project, f"/models/{path.name}", path.parent, mesh_from_model(path.name), BASE_IMAGE
    )


def build_images() -> None:
    run(
        [
            "docker",
            "build",
            "--tag",
            "kvmesh:latest",
            "--build-arg",
            f"BASE={BASE_IMAGE}",
            "--build-arg",
            f"WHEELHOUSE={WHEELHOUSE}",
            str(ROOT),
        ],
        BUILD_TIMEOUT_S,
    )
    run(
        [
            "docker",
            "build",
            "--tag",
            "kvmesh-prometheus:latest",
            "--build-arg",
            f"BASE={BASE_IMAGE}",
            str(ROOT / "deploy" / "prometheus"),
        ],
        BUILD_TIMEOUT_S,
    )


def expectations(model: str, max_tokens: int, ignore_eos: bool = False) -> dict[str, str]:
    """``kvmesh generate``'s greedy text for each prompt, on this host."""
    return {p: checks.generate(model, p, max_tokens, ignore_eos)["text"] for p in checks.PROMPTS}


def run_checks(
    stack: Stack, model: str, timings: dict[str, float]
) -> list[tuple[str, checks.Verdict]]:
    """Up, the checks in order (a failed one is reported, the rest still run), always down."""
    results: list[tuple[str, checks.Verdict]] = []

    def attempt(name: str, step: Callable[[], checks.Verdict]) -> None:
        start = time.monotonic()
        try:
            results.append((name, step()))
        except Exception as exc:  # a check that cannot complete is a failed check, said why
            results.append((name, checks.Verdict(False, f"{type(exc).__name__}: {exc}")))
        timings[name] = log_step(name, start)

    short = expectations(model, 16)
    long = expectations(model, checks.LOAD_TOKENS, ignore_eos=True)
    start = time.monotonic()
    try:
        stack.up()
        prometheus = stack.containers("prometheus")[0]
        stack.wait_healthy(prometheus, 300)
        timings["up"] = log_step("up (every service healthy)", start)
        attempt("completions", lambda: asyncio.run(checks.check_completions(stack, model, short)))
        attempt("replicas", lambda: asyncio.run(checks.check_replicas(stack)))
        attempt("prometheus", lambda: asyncio.run(checks.check_prometheus(stack)))
        attempt("decode-kill", lambda: asyncio.run(checks.check_kill(stack, long)))
    except HostError as exc:
        results.append(("up", checks.Verdict(False, str(exc))))
    finally:
        if not all(v.passed for _, v in results):
            stack.logs(stack_logs := Path(stack.env_file).with_name("compose.log"))
            log(f"container logs: {stack_logs}")
        attempt("down", lambda: checks.check_down(stack))
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="kvmesh-compose-test-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        settings = stack_settings(args.model)
    except HostError as exc:
        print(f"compose-test: error: {exc}", file=sys.stderr)
        return 2
    timings: dict[str, float] = {}
    with contextlib.ExitStack() as resources:
        start = time.monotonic()
        try:
            ensure_tools()
            compose = compose_command()
            assert compose is not None  # ensure_tools installed one
            resources.enter_context(docker_daemon(out / "dockerd.log"))
        except HostError as exc:
            if args.if_possible:
                print(f"compose-test: SKIP this host cannot run Docker: {exc}")
                return 0
            print(f"compose-test: FAIL docker: {exc}")
            return 1
        timings["docker"] = log_step(f"docker ({' '.join(compose)})", start)
        for name, step in (
            ("base image", ensure_base_image),
            ("wheelhouse", lambda: ensure_wheelhouse(ROOT / WHEELHOUSE, ROOT / ".venv/bin/pip")),
            ("images", build_images),
        ):
            start = time.monotonic()
            try:
                step()
            except HostError as exc:
                print(f"compose-test: FAIL {name}: {exc}")
                return 1
            timings[name] = log_step(name, start)
        results = run_checks(Stack(compose, settings, out), args.model, timings)
    for name, verdict in results:
        print(f"compose-test: {'PASS' if verdict.passed else 'FAIL'} {name}: {verdict.detail}")
    print("compose-test: seconds " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))
    passed = sum(v.passed for _, v in results)
    print(f"compose-test: {passed} passed, {len(results) - passed} failed")  # CI reads this line
    return 0 if results and passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
