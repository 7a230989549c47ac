"""``kvmesh nats-config``: the nats-server authorization block of a kvmesh mesh (one user per
role, shared/nats_auth.py), for running the control plane on a server kvmesh does not start."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "nats-config",
        help="print the nats-server authorization block (one user per role) or make passwords",
        description="Without options: the authorization block, each password an environment "
        "variable reference ($KVMESH_NATS_PASSWORD_<ROLE>) that nats-server resolves at start "
        "(deploy/nats-auth.conf is this output). --env-file PATH: write fresh random passwords "
        "for those variables into PATH (mode 0600), e.g. docker compose's .env.",
    )
    p.add_argument("--env-file", type=Path, help="write KVMESH_NATS_PASSWORD_<ROLE>=... here")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from shared.nats_auth import MeshCredentials, authorization_block

    if args.env_file is None:
        print(authorization_block(), end="")
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
