"""The one error of ``kvmesh up``'s start-up and supervision (launcher.py, mesh_nats.py)."""

from __future__ import annotations


class LaunchError(RuntimeError):
    """A service exited or did not become ready; the message says which and how to look."""
