"""``python -m kvmesh``: the same as the ``kvmesh`` command."""

from kvmesh.cli import run

run()
