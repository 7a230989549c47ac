"""``kvmesh up``: the whole mesh on this machine, one process per service.

Starts nats-server when nothing answers at --nats-url, then the kv-registry, N prefill and M
decode (or M colocated) workers and the router, each as ``python -m kvmesh.cli serve ...`` in its
own session (process group), so a terminal's Ctrl-C reaches only the launcher, which then stops
them in order: router, prefill, decode, registry, NATS — SIGTERM, SIGKILL after --stop-timeout-s.
Children also get SIGTERM from the kernel if the launcher itself dies (PR_SET_PDEATHSIG).

Two meshes on one machine: each has a name (--mesh, default from the model) and its own
subjects. Left at its default --nats-url, a second ``kvmesh up`` whose port 4222 holds another
mesh's nats-server starts one of its own on a free port; ``kvmesh admin --mesh NAME`` finds it
through the state file each launcher keeps (shared/bus/mesh_state.py). The same mesh twice on one
NATS, or a taken HTTP port, is refused in one line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys

from kvmesh.commands.launch_error import LaunchError
from kvmesh.commands.launcher import Launcher
from kvmesh.commands.restarts import RestartPolicy
from kvmesh.commands.up_config import EXAMPLES, FLAG_GROUPS, UpConfig
from kvmesh.commands.up_model import ModelChoiceError, resolve_up_model
from kvmesh.commands.up_plan import cpu_plan, split_cores
from kvmesh.shared.config.nats_options import redact_url
from kvmesh.shared.config.service_config import (
    add_config_arguments,
    command_config,
)


async def run_up(launcher: Launcher) -> int:
    from kvmesh.shared.bus.service_lifetime import serve_until_signal

    stop = asyncio.Event()

    async def watch() -> None:
        # --max-restarts 0: the first death of a needed service stops the mesh, an optional
        # one (kv-store, draft) is left down
        await launcher.supervise(RestartPolicy(max_restarts=launcher.config.max_restarts))

    async def ready_then_watch() -> None:
        await launcher.wait_ready()
        print(
            f"kvmesh is up: {launcher.url}/v1 (mesh {launcher.mesh}, mode "
            f"{launcher.config.mode}, {launcher.config.decode} decode, "
            f"{launcher.config.prefill if launcher.config.mode == 'disagg' else 0} prefill, "
            + (
                f"{launcher.config.draft_workers} draft ({launcher.config.draft}), "
                if launcher.config.draft
                else ""
            )
            + f"NATS {redact_url(launcher.nats_url)}); Ctrl-C stops it",
            flush=True,
        )
        cpus = launcher.cpus
        threads = ", ".join(f"{role} {n}" for role, n in split_cores(launcher.config, cpus).items())
        print(f"kvmesh up: torch threads per worker: {threads}", flush=True)
        print(f"kvmesh up: {(cpus or cpu_plan(launcher.config)).describe()}", flush=True)
        metrics = ", ".join(f"{name} {url}" for name, url in launcher.metrics_urls.items())
        print(f"kvmesh up: metrics: {metrics}", flush=True)
        await watch()

    task = asyncio.create_task(ready_then_watch())
    task.add_done_callback(lambda _: stop.set())
    if await serve_until_signal(stop) is not None:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task  # raises LaunchError when a service died or never got ready
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "up",
        allow_abbrev=False,
        help="run the whole mesh locally (NATS, kv-registry, prefill, decode, router)",
        usage="%(prog)s [OPTIONS]",
        description=(__doc__ or "").strip().splitlines()[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(parser, UpConfig, groups=FLAG_GROUPS)
    parser.set_defaults(func=_up)


def _up(args: argparse.Namespace) -> int:
    from kvmesh.shared.bus.nats_server import NatsServerError
    from kvmesh.shared.config.service_errors import ServiceStartError, check_can_listen

    config = command_config(UpConfig, args, "kvmesh up")
    if config is None:
        return 2
    try:
        check_can_listen(config.host, config.port)  # before anything starts
        config = resolve_up_model(config)  # may fetch or import it (once per machine)
    except (ServiceStartError, ModelChoiceError) as exc:
        print(f"kvmesh up: {exc}", file=sys.stderr)
        return 1
    launcher = Launcher(config)
    signal.signal(signal.SIGTERM, _interrupt)  # while starting: SIGTERM acts like Ctrl-C
    try:
        launcher.start()
        return asyncio.run(run_up(launcher))
    except (LaunchError, NatsServerError) as exc:
        print(f"kvmesh up: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        # the shutdown is bounded by --stop-timeout-s per tier; do not let a second signal cut it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("kvmesh up: stopping", file=sys.stderr)
        launcher.stop()
        print("kvmesh up: stopped", file=sys.stderr)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
