"""``kvmesh nats-config``: the nats-server authorization block of a kvmesh mesh (one user per
role, shared/bus/nats_auth.py), for running the control plane on a server kvmesh does not start."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvmesh.shared.config.subjects import DEFAULT_MESH


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "nats-config",
        help="print the nats-server authorization block (one user per role) or make passwords",
        description="Without options: the authorization block, each password an environment "
        "variable reference ($KVMESH_NATS_PASSWORD_<ROLE>) that nats-server resolves at start "
        "(deploy/nats-auth.conf is this output). --env-file PATH: write fresh random passwords "
        "for those variables into PATH (mode 0600), e.g. docker compose's .env.",
    )
    p.add_argument("--env-file", type=Path, help="write KVMESH_NATS_PASSWORD_<ROLE>=... here")
    p.add_argument(
        "--mesh",
        default=os.environ.get("KVMESH_MESH", DEFAULT_MESH),
        help="the mesh whose subjects the roles may use (default: $KVMESH_MESH, else "
        f"{DEFAULT_MESH}, the built-in model's mesh and docker-compose's)",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from kvmesh.shared.bus.nats_auth import MeshCredentials, authorization_block
    from kvmesh.shared.config.subjects import Subjects

    if args.env_file is None:
        try:
            subjects = Subjects(args.mesh)
        except ValueError as exc:
            raise SystemExit(f"kvmesh nats-config: --mesh: {exc}") from None
        print(authorization_block(subjects), end="")
        return 0
    try:
        fd = os.open(args.env_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise SystemExit(
            f"kvmesh nats-config: {args.env_file} exists; keep its passwords, or remove it first"
        ) from None
    with os.fdopen(fd, "w") as f:
        f.write(MeshCredentials.generate().env_file())
    print(f"wrote fresh NATS passwords for every role to {args.env_file} (mode 0600)")
    return 0
