"""Fixtures of the kernel tests."""

import pytest
from kvmesh.kernels.cpu_ops import load_cpu_ops


@pytest.fixture(scope="module")
def ops():
    """The CPU kernels, built for this machine (gcc is part of the test machine)."""
    ops = load_cpu_ops()
    assert ops is not None, "gcc is part of the test machine; the C kernels must build"
    return ops
