"""Shared pytest fixtures.

Mesh fixtures (real nats-server on a free port) come first; other engineers append their own
fixtures in the clearly marked section at the end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
from kvmesh.shared.bus.nats_server import NatsServer

# --- mesh: NATS -----------------------------------------------------------------------------


@pytest.fixture
def nats_server() -> Iterator[str]:
    """A fresh nats-server (JetStream on) for one test; yields its URL, e.g. nats://127.0.0.1:41234."""
    with NatsServer() as server:
        yield server.url


@pytest.fixture(scope="module")
def nats_server_module() -> Iterator[str]:
    """One nats-server shared by every test of a module (cheaper; tests must not rely on a clean
    server, e.g. use unique subjects or worker ids)."""
    with NatsServer() as server:
        yield server.url


@pytest.fixture
def nats_server_process() -> Iterator[NatsServer]:
    """The NatsServer object itself, for tests that stop and restart it (same port)."""
    server = NatsServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest_asyncio.fixture
async def nats_client(nats_server: str) -> AsyncIterator[object]:
    """A connected nats-py client on the per-test server."""
    from kvmesh.shared.bus.nats_connect import connect_nats

    async with connect_nats(nats_server, "pytest") as nc:
        yield nc


# --- fixtures from other engineers below this line (append only) ---------------------------


@pytest.fixture(scope="session", autouse=True)
def mesh_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """The suite records and looks up running meshes (shared/bus/mesh_state.py) in a folder of its
    own, never the user's: a `kvmesh up` outside the suite neither disturbs nor is disturbed.
    Session-wide, so module fixtures that start meshes use it too."""
    folder = tmp_path_factory.mktemp("mesh-state")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVMESH_STATE_DIR", str(folder))
        yield folder


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``gpu``-marked tests (`make gpu-check`, docs/gpu.md) run the compiled Triton kernels and
    the engine on CUDA: skipped, with the reason, where there is no CUDA device or where
    TRITON_INTERPRET=1 would interpret the kernels instead."""
    for item in items:
        if _starts_processes(item):
            item.add_marker(pytest.mark.processes)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import os

    import torch

    if not torch.cuda.is_available():
        reason = "no CUDA device"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        reason = "TRITON_INTERPRET=1: gpu tests run the compiled kernels (make gpu-check)"
    else:
        return
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason=reason))


# What starts a process (a nats-server, a service, a whole mesh, a tool): a test that uses one of
# these fixtures, or lives in a module that names one of these, is marked ``processes``.
# `make test-fast` runs the rest: the pure cores, in one process (-m "not slow and not processes").
PROCESS_FIXTURES = {"nats_server", "nats_server_module", "nats_server_process", "nats_client"}
PROCESS_WORDS = ("subprocess", "NatsServer", "launched(", "local_mesh(", "multiprocessing", "Popen")
_module_starts_processes: dict[str, bool] = {}


def _starts_processes(item: pytest.Item) -> bool:
    if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    path = str(item.path)
    if path not in _module_starts_processes:
        text = item.path.read_text(errors="replace")
        _module_starts_processes[path] = any(word in text for word in PROCESS_WORDS)
    return _module_starts_processes[path]


@pytest.fixture(scope="module")
def tiny() -> object:
    """kvmesh-tiny in its own dtype, a (model, tokenizer) pair, loaded once per test module:
    the engine, worker and mesh tests run on it."""
    from kvmesh.shared.model.loader import load_model

    return load_model("kvmesh-tiny")


@pytest.fixture(scope="module")
def tiny_float32(tiny: tuple[object, object]) -> object:
    """kvmesh-tiny in float32, a (model, tokenizer) pair: what the 8-bit KV cache tests
    (test_engine_8bit.py, test_engine_fp8.py, test_engine_int8.py) measure against. kvmesh-tiny's
    own dtype is float32, so this is ``tiny`` (checked, should that dtype ever change)."""
    import torch

    model = tiny[0]
    dtype = next(model.parameters()).dtype  # type: ignore[attr-defined]
    assert dtype == torch.float32, f"kvmesh-tiny loads as {dtype}: load a float32 copy here"
    return tiny


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The default Llama and Qwen2 checkpoints of tests/support/hf_fixtures.py (``"llama"``,
    ``"qwen2"``: their directories), written once per session: read them, never write into them
    (copy one to break it)."""
    from support.hf_fixtures import make_llama_checkpoint, make_qwen2_checkpoint

    root = tmp_path_factory.mktemp("hf-checkpoints")
    return {"llama": make_llama_checkpoint(root), "qwen2": make_qwen2_checkpoint(root)}
