"""``kvmesh admin status|workers|drain WORKER|resume WORKER|log-level LEVEL|prefill-queue
[--json]``."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from kvmesh.shared.config.nats_options import NatsClientConfig
from kvmesh.shared.config.service_config import (
    DEFAULT_NATS_URL,
    add_config_arguments,
    check_positive,
    command_config,
    option,
)
from kvmesh.shared.config.subjects import DEFAULT_MESH
from kvmesh.shared.obs.logs import LEVELS

if TYPE_CHECKING:
    from kvmesh.shared.bus.nats_auth import NatsAuth

# A JSON object of the registry's replies (``shared/bus/admin_client.py``), its fields read by name.
Reply = Mapping[str, object]


@dataclass(frozen=True, slots=True)
class AdminConfig(NatsClientConfig):
    """Without --mesh: the one mesh ``kvmesh up`` runs on this machine, else the default mesh.
    Without --nats-url: that mesh's NATS as ``kvmesh up`` recorded it (shared/bus/mesh_state.py),
    with its admin password when the environment holds no credentials."""

    admin_timeout_s: float = option(3.0, help="seconds to wait for the registry's answer")

    def __post_init__(self) -> None:
        self.check_nats_options(None)  # the mesh is looked up (resolve_target)
        check_positive(self, "admin_timeout_s")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("admin", help="inspect and steer a running mesh (via the kv-registry)")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    specs: tuple[tuple[str, str, str | None], ...] = (
        ("status", "decode pools (blocks, running, state), kv stores, other workers, leases", None),
        ("workers", "every live worker: role, state, load", None),
        ("drain", "stop placing new requests on WORKER; running ones finish", "worker"),
        ("resume", "place requests on WORKER again", "worker"),
        ("log-level", "set the log level of every service", "level"),
        (
            "prefill-queue",
            "make the mesh's JetStream prefill queue (or put it back) as the NATS user admin: "
            "what kvmesh up does at start; compose and an operator's own server run it once",
            None,
        ),
    )
    for name, help_text, arg in specs:
        p = actions.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        if arg == "worker":
            p.add_argument("worker", help="worker id (see `kvmesh admin workers`)")
        elif arg == "level":
            p.add_argument("level", choices=LEVELS)
        p.add_argument("--json", action="store_true", help="print the raw JSON reply")
        add_config_arguments(p, AdminConfig)
        p.set_defaults(func=_admin)


def _admin(args: argparse.Namespace) -> int:
    from kvmesh.shared.bus.admin_client import AdminError
    from kvmesh.shared.bus.nats_connect import NatsUnavailableError
    from kvmesh.shared.bus.prefill_job_stream import PrefillQueueError
    from kvmesh.shared.obs import logs

    logs.setup_logging("warning")

    config = command_config(AdminConfig, args, "kvmesh admin")
    if config is None:
        return 2
    try:
        result = asyncio.run(
            run_admin(
                config, args.action, getattr(args, "worker", None) or getattr(args, "level", None)
            )
        )
    except (AdminError, NatsUnavailableError, PrefillQueueError) as exc:
        print(f"kvmesh admin {args.action}: {exc}", file=sys.stderr)
        return 1
    print(
        json.dumps(result, indent=2, sort_keys=True) if args.json else render(args.action, result)
    )
    return 0


@dataclass(frozen=True, slots=True)
class AdminTarget:
    """The mesh an admin command addresses and how to reach its NATS."""

    mesh: str
    nats_url: str
    auth: NatsAuth | None  # None: the environment's credentials, if any


def resolve_target(config: AdminConfig) -> AdminTarget:
    """Which mesh and NATS: the flags and environment first, then what ``kvmesh up`` recorded
    (of the meshes on --nats-url when it is given)."""
    from kvmesh.shared.bus.admin_client import AdminError
    from kvmesh.shared.bus.mesh_state import running_meshes
    from kvmesh.shared.bus.nats_auth import ADMIN, NatsAuth, auth_from_env
    from kvmesh.shared.config.nats_options import strip_credentials

    url = config.nats_url
    url_given = url != DEFAULT_NATS_URL
    known = [m for m in running_meshes() if not url_given or m.nats_url == strip_credentials(url)]
    mesh = config.mesh
    if mesh is None:
        names = sorted({m.mesh for m in known})
        if len(names) > 1:
            raise AdminError(
                f"{len(names)} meshes are up on this machine ({', '.join(names)}): say which "
                "with --mesh NAME (or KVMESH_MESH)"
            )
        mesh = names[0] if names else DEFAULT_MESH
    mine = [m for m in known if m.mesh == mesh]
    if not url_given and mine:
        if len({m.nats_url for m in mine}) > 1:
            raise AdminError(
                f"mesh {mesh!r} is up more than once on this machine (NATS "
                f"{', '.join(m.nats_url for m in mine)}): say which with --nats-url"
            )
        url = mine[0].nats_url
    auth = auth_from_env()
    if auth is None:  # the admin password of the nats-server kvmesh up started there
        for state in mine:
            if state.nats_url == strip_credentials(url) and state.admin_password_file:
                try:
                    password = Path(state.admin_password_file).read_text().strip()
                except OSError:
                    continue
                auth = NatsAuth(ADMIN, password)
                break
    return AdminTarget(mesh, url, auth)


async def run_admin(config: AdminConfig, action: str, arg: str | None) -> dict[str, object]:
    """The registry's typed reply as the JSON it came as (what --json prints and render reads)."""
    import msgspec

    from kvmesh.shared.bus.admin_client import admin_client

    target = resolve_target(config)
    if action == "prefill-queue":  # JetStream itself, not the registry: admin's rights
        from kvmesh.commands.queue_setup import make_prefill_queue
        from kvmesh.shared.config.subjects import Subjects

        state = await make_prefill_queue(
            target.nats_url, target.mesh, auth=target.auth, security=config.nats_security
        )
        return {
            "stream": Subjects(target.mesh).PREFILL_STREAM,
            **{k: getattr(state, k) for k in ("replicas", "wanted_replicas", "depth")},
            "made": list(state.made),
            "problems": list(state.problems),
        }
    async with admin_client(
        target.nats_url,
        config.admin_timeout_s,
        auth=target.auth,
        mesh=target.mesh,
        security=config.nats_security,
    ) as admin:
        if action == "status":
            status = msgspec.to_builtins(await admin.status())
            return {**status, "draft": await admin.draft_workers()}
        if action == "workers":
            return {"workers": msgspec.to_builtins(await admin.workers())}
        assert arg is not None, action
        if action == "drain":
            return msgspec.to_builtins(await admin.drain(arg))
        if action == "resume":
            return msgspec.to_builtins(await admin.resume(arg))
        if action == "log-level":
            return msgspec.to_builtins(await admin.log_level(arg))
    raise AssertionError(f"unknown admin action {action!r}")


# --- rendering --------------------------------------------------------------------------------


def render(action: str, result: Reply) -> str:
    if action == "status":
        return render_status(result)
    if action == "workers":
        return table(
            cast("Sequence[Reply]", result["workers"]),
            ("worker_id", "role", "state", "tp", "num_running", "num_waiting", "last_seen_s"),
        )
    if action == "log-level":
        return f"log level set to {result['level']} on every service"
    if action == "prefill-queue":
        made = ", ".join(cast("list[str]", result["made"])) or "nothing (it was there)"
        problems = "; ".join(cast("list[str]", result["problems"])) or "none"
        return (
            f"prefill queue {result['stream']}: made {made}; replicas {result['replicas']} "
            f"of {result['wanted_replicas']}, {result['depth']} jobs waiting; problems: {problems}"
        )
    state = f" (now {result['state']})" if "state" in result else ""
    return f"{result['action']} sent to {result['worker']}{state}"


def _flat(row: Reply) -> Reply:
    """A row with its parts' fields beside its own (the parts' names do not overlap)."""
    flat = {k: v for k, v in row.items() if not isinstance(v, dict)}
    for part in (v for v in row.values() if isinstance(v, dict)):
        flat.update(part)
    return flat


def _object(reply: Reply, key: str) -> Reply:
    """The JSON object ``reply[key]`` (absent: empty)."""
    return cast("Reply", reply.get(key, {}))


def _rows(reply: Reply, key: str) -> Sequence[Reply]:
    """The list of JSON objects ``reply[key]`` (absent: empty)."""
    return cast("Sequence[Reply]", reply.get(key, []))


def render_status(status: Reply) -> str:
    registry = _object(status, "registry")
    leases = _object(status, "leases")
    others = [
        w
        for w in _rows(status, "workers")
        if w["role"] not in ("decode", "colocated", "draft", "kv-store")
    ]
    degraded = cast("list[str]", status.get("degraded", []))
    parts = [
        f"kv-registry {registry.get('worker_id', '?')} (up {registry.get('uptime_s', 0):.0f}s)",
        *([f"degraded: {'; '.join(degraded)}"] if degraded else []),
        "",
        "decode workers:",
        table(
            _rows(status, "decode"),
            (
                "worker_id",
                "role",
                "state",
                "total_blocks",
                "free_blocks",
                "num_running",
                "num_waiting",
                "leases",
                "cached_blocks",
                "refused_accesses",
            ),
        ),
        "",
        "draft workers (acceptance: accepted / verified draft positions, as decode reported):",
        table(
            _rows(status, "draft"),
            (
                "worker_id",
                "method",
                "k",
                "tree",
                "sequences",
                "proposals",
                "verified_tokens",
                "accepted_tokens",
                "acceptance",
            ),
        ),
        "",
        "kv stores (blocks; disk_*: the disk tier; hit rate: blocks served / blocks asked for):",
        table(
            _rows(status, "stores"),
            (
                "store_id",
                "state",
                "total_blocks",
                "used_blocks",
                "pinned_blocks",
                "disk_total_blocks",
                "disk_used_blocks",
                "hit_rate",
                "disk_hits",
                "evictions",
                "refused_accesses",
            ),
        ),
        "",
        "other workers:",
        table(
            others,
            ("worker_id", "role", "state", "tp", "num_running", "num_waiting", "last_seen_s"),
        ),
        "",
        "leases: " + ", ".join(f"{k} {v}" for k, v in leases.items()),
        "prefill queue: "
        + ", ".join(f"{k} {v}" for k, v in _object(status, "prefill_queue").items()),
    ]
    return "\n".join(parts)


def table(rows: Sequence[Reply], columns: Sequence[str]) -> str:
    """``rows`` as a table of ``columns``; a column names a field of the row or of one of its
    parts (a decode row's ``load``, ``pool``, ``reach`` and ``refusals``)."""
    if not rows:
        return "  (none)"
    cells = [[str(_flat(row).get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    line = lambda values: "  " + "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True))
    return "\n".join(line(r).rstrip() for r in [list(columns), *cells])
