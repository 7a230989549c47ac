"""``kvmesh serve router|prefill|decode|kv-registry|colocated|draft|kv-store|prefill-queue [flags]``:
run one service.

Contract (docs/mesh.md): ``services.<module>`` exposes ``CONFIG`` (its config dataclass, built here
from flags and KVMESH_* env) and ``async def run(config) -> None`` (returns on SIGTERM/SIGINT
after a graceful stop). ``colocated`` is the decode service with ``mode="colocated"``.
Service flags are parsed lazily so that ``kvmesh --help`` never imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from types import ModuleType
from typing import TYPE_CHECKING

from kvmesh.shared.config.service_config import (
    ConfigError,
    add_config_arguments,
    config_from_args,
    known_env_keys,
    unknown_env_keys,
)

if TYPE_CHECKING:
    from kvmesh.shared.config.worker_config import ServiceConfig
    from kvmesh.shared.obs.logs import LogConfig

# service name -> (module, config overrides)
SERVICES: dict[str, tuple[str, dict[str, object]]] = {
    "router": ("kvmesh.services.router", {}),
    "prefill": ("kvmesh.services.prefill", {}),
    "decode": ("kvmesh.services.decode", {}),
    "kv-registry": ("kvmesh.services.kv_registry", {}),
    "colocated": ("kvmesh.services.decode", {"mode": "colocated"}),
    "draft": ("kvmesh.services.draft", {}),
    "kv-store": ("kvmesh.services.kv_store", {}),
    "prefill-queue": ("kvmesh.services.prefill_queue", {}),
}


class ServiceNotAvailableError(RuntimeError):
    """The service's module does not exist (yet) or does not follow the serve contract."""


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    name: str
    module: ModuleType
    config_cls: type
    overrides: dict[str, object]


def load_service(name: str) -> ServiceSpec:
    if name not in SERVICES:
        raise ServiceNotAvailableError(
            f"unknown service {name!r}; choose one of {', '.join(SERVICES)}"
        )
    module_name, overrides = SERVICES[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise ServiceNotAvailableError(
                f"service {name!r} is not available: module {module_name} does not exist in this "
                "checkout"
            ) from None
        raise
    config_cls = getattr(module, "CONFIG", None)
    run = getattr(module, "run", None)
    if config_cls is None or not callable(run):
        raise ServiceNotAvailableError(
            f"{module_name} must expose CONFIG (its config dataclass) and async run(config)"
        )
    names = {f.name for f in fields(config_cls)}
    missing = set(overrides) - names
    if missing:
        raise ServiceNotAvailableError(
            f"{module_name}.CONFIG has no field(s) {sorted(missing)} needed by `serve {name}`"
        )
    return ServiceSpec(name, module, config_cls, dict(overrides))


def service_parser(spec: ServiceSpec) -> argparse.ArgumentParser:
    from kvmesh.shared.obs.logs import LogConfig

    parser = argparse.ArgumentParser(
        prog=f"kvmesh serve {spec.name}",
        allow_abbrev=False,  # `--mode` must not silently mean `--model`
        description=(spec.module.__doc__ or "").strip().splitlines()[0]
        if spec.module.__doc__
        else None,
    )
    add_config_arguments(parser, spec.config_cls, exclude=spec.overrides)
    add_config_arguments(parser, LogConfig)
    return parser


def service_env_keys(name: str) -> set[str]:
    """Every KVMESH_* variable ``kvmesh serve <name>`` reads (its config's and logging's)."""
    from kvmesh.shared.bus.nats_auth import PASSWORD_ENV, PASSWORD_FILE_ENV, USER_ENV
    from kvmesh.shared.obs.logs import LogConfig

    spec = load_service(name)
    keys = known_env_keys(spec.config_cls) | known_env_keys(LogConfig)
    keys.add("KVMESH_CACHE_DIR")  # where kernels/cpu_ops.py keeps the compiled C kernels
    keys |= {USER_ENV, PASSWORD_ENV, PASSWORD_FILE_ENV}  # every service logs in to NATS with them
    return keys - {f"KVMESH_{k.upper()}" for k in spec.overrides}


def build_service_config(
    name: str, argv: Sequence[str], env: Mapping[str, str] | None = None
) -> tuple[ServiceSpec, ServiceConfig, LogConfig]:
    """Parse ``argv`` (the flags after ``serve <name>``) -> (spec, service config, LogConfig).

    Exits (argparse) on unknown flags; raises ConfigError on bad values."""
    from kvmesh.shared.obs.logs import LogConfig

    env = os.environ if env is None else env
    spec = load_service(name)
    args = service_parser(spec).parse_args(list(argv))
    config: ServiceConfig = config_from_args(spec.config_cls, args, env, **spec.overrides)
    log_config = config_from_args(LogConfig, args, env)
    return spec, config, log_config


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "serve",
        help="run one service (router, prefill, decode, kv-registry, colocated, draft, kv-store, "
        "prefill-queue)",
        description="Run one kvmesh service. `kvmesh serve SERVICE --help` lists its flags.",
    )
    parser.add_argument("service", choices=tuple(SERVICES), help="the service to run")
    parser.add_argument(
        "service_args", nargs=argparse.REMAINDER, help="the service's flags (see SERVICE --help)"
    )
    parser.set_defaults(func=_serve)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Serve with the start-up heap frozen (``gc.freeze``), as vLLM and SGLang do: what the
    imports made (torch and the service's modules, ~200,000 objects) leaves the collector's
    reach, so a full collection while serving, or while the service loads its model, walks
    only what was made since. Unfrozen, one took 150-177 ms on the 2-core box, a stall of every
    stream's next token; frozen, about 2 ms (``kvmesh bench gc``). No collection first: it
    would cost every service start that much, to free the little garbage imports leave.
    Unfrozen again on the way out, so that ``kvmesh.cli.run`` decides what exit collects."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _serve(args: argparse.Namespace) -> int:
    from kvmesh.shared.bus.nats_connect import NatsUnavailableError
    from kvmesh.shared.bus.prefill_job_stream import PrefillQueueError
    from kvmesh.shared.config.nats_options import redact_url
    from kvmesh.shared.config.open_files import raise_open_file_limit
    from kvmesh.shared.config.service_errors import ServiceStartError, find_error
    from kvmesh.shared.obs import logs

    try:
        spec, config, log_config = build_service_config(args.service, args.service_args)
    except (ConfigError, ServiceNotAvailableError) as exc:
        print(f"kvmesh serve {args.service}: {exc}", file=sys.stderr)
        return 2
    logs.setup_logging(log_config.log_level, log_config.log_format)
    log = logs.get_logger("kvmesh.serve")
    ignored = unknown_env_keys(spec.config_cls, os.environ, also_known=service_env_keys(spec.name))
    if ignored:
        log.info("ignoring KVMESH_* variables this service does not read", keys=ignored)
    shown = repr(config)
    if getattr(config, "nats_url", None):  # a token or password in the URL never reaches a log
        shown = shown.replace(config.nats_url, redact_url(config.nats_url))
    soft, _ = raise_open_file_limit()  # a connection flood must not hit a 1,024 default
    log.info("starting", service=spec.name, open_files=soft)
    log.debug("config", service=spec.name, config=shown)  # every field: long, so at debug
    try:
        with frozen_heap():
            asyncio.run(spec.module.run(config))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        # what the operator can fix (NATS unreachable or without JetStream, a port taken): one
        # line that says what to do, no traceback
        fatal = find_error(exc, (NatsUnavailableError, PrefillQueueError, ServiceStartError))
        if fatal is None:
            raise
        print(f"kvmesh serve {spec.name}: {fatal}", file=sys.stderr)
        return 1
    log.info("stopped", service=spec.name)
    return 0
