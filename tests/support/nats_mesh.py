"""A real nats-server with a mesh's users and permissions (shared/bus/nats_auth.py), as module
fixtures: ``creds, server = mesh_server_fixtures(subjects)`` at a test module's top level."""

from __future__ import annotations

import pytest
from kvmesh.shared.bus.nats_auth import MeshCredentials
from kvmesh.shared.bus.nats_server import NatsServer
from kvmesh.shared.config.subjects import Subjects


def mesh_server_fixtures(subjects: Subjects):
    """The fixtures ``creds`` (fresh credentials for every role) and ``server`` (a nats-server
    that admits those users with their permissions on ``subjects``), one of each per module."""

    @pytest.fixture(scope="module")
    def creds() -> MeshCredentials:
        return MeshCredentials.generate()

    @pytest.fixture(scope="module")
    def server(creds: MeshCredentials):
        with NatsServer(authorization=creds.server_config(subjects)) as s:
            yield s

    return creds, server
