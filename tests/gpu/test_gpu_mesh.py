"""The mesh end to end with its KV pool in GPU memory: a colocated mesh (real nats-server,
registry, router and one worker process, kvmesh-tiny) whose worker runs on CUDA serves greedy
output equal to the offline engine on CUDA, token for token, and returns every block.

Only colocated: a disaggregated worker on CUDA needs the rdma transport (GPU memory registered
as a dma-buf MR, which a real RDMA NIC can reach and SoftRoCE cannot); shm and tcp move host
memory, have no staging through pinned host memory, and a CUDA worker with either is refused at
startup (shared/config/worker_config.py; docs/gpu.md).

``gpu``-marked: skipped without CUDA; `make gpu-check` runs it. Never yet run on real hardware.
"""

from __future__ import annotations

import pytest
from support.mesh_checks import check_blocks_returned, check_equals_offline, load

from kvmesh.testing.mesh import launched, mesh_config, random_prompts
from kvmesh.testing.offline import offline_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

ENV = {
    "KVMESH_BLOCK_SIZE": "16",
    "KVMESH_NUM_BLOCKS": "1024",
}
PROMPTS = random_prompts(16, 40, 150, seed=9)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def offline_cuda_tokens() -> list[list[int]]:
    return offline_greedy(PROMPTS, MAX_TOKENS, 1024, device="cuda")


@pytest.fixture(scope="module")
def cuda_mesh():
    config = mesh_config(
        mode="colocated",
        device="cuda",  # `kvmesh up` passes --device to every worker
    )
    with launched(config, ENV) as mesh:
        yield mesh


async def test_colocated_mesh_on_cuda_serves_as_offline_engine_on_cuda(
    cuda_mesh, offline_cuda_tokens
):
    replies, tap = await load(cuda_mesh, PROMPTS, MAX_TOKENS)
    check_equals_offline(replies, tap, offline_cuda_tokens)
    await check_blocks_returned(cuda_mesh)
