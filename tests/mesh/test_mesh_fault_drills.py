"""Faults under streaming load on one real mesh (kvmesh up's Launcher and supervisor, real
processes: 1 prefill and 2 decode workers with n-gram drafts, kvmesh-tiny), each drill from
kvmesh.loadgen.fault_scenarios:

- 20 clients that stop reading beside normal streams: each is cut off, its request aborted (its
  blocks and its draft context go), no traceback; the normal streams keep their token gaps,
  /metrics answers, the router keeps its heartbeats;
- kill -9 of the nats-server, restarted by the supervisor after 1 s and after 10 s: nobody is
  counted dead, at least 95% of the streams end with the offline engine's greedy text, the rest
  with a clear error, none hangs;
- the kv-registry killed while it holds placements: they are asked again of the restarted one;
- kill -9 of a decode worker mid-stream: its streams migrate, the draft worker drops their
  contexts;
- SIGSTOP of a decode worker for 6 s: no reservation outlives its request.

Every drill ends with every decode block free within 10 s of the end of its load and no draft
context left. The services log into a file of the module's (a child keeps the stderr it was
started with, which capfd never sees), read by each test for what its drill logged."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from kvmesh.loadgen import prom_text
from kvmesh.loadgen.drill_streams import tally
from kvmesh.loadgen.fault_scenarios import (
    ENV,
    decode_stop,
    nats_outage,
    registry_kill,
    stalled_clients,
    worker_kill,
)

from kvmesh.testing.mesh import launched, mesh_config, random_prompts
from kvmesh.testing.offline import offline_texts

pytestmark = pytest.mark.slow

MAX_TOKENS, CONCURRENCY = 24, 6
# small limits: a stalled client (~4 KB/s of SSE at the paced decode) is cut off in seconds
CLIENT_ENV = {"KVMESH_CLIENT_WRITE_TIMEOUT_S": "2", "KVMESH_CLIENT_SEND_BUFFER_KB": "4"}


class MeshLog:
    """The services' output, one file for the module's mesh; ``new()`` is what they wrote since
    the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = path.open("wb", buffering=0)
        self._read = 0

    def new(self) -> str:
        with self.path.open("rb") as f:
            f.seek(self._read)
            data = f.read()
        self._read += len(data)
        return data.decode(errors="replace")


@pytest.fixture(scope="module")
def mesh_log(tmp_path_factory):
    log = MeshLog(tmp_path_factory.mktemp("fault-drills") / "mesh.log")
    yield log
    log.file.close()


@pytest.fixture
def logged(mesh, mesh_log):
    """What the services log during one test (from its start)."""
    mesh_log.new()
    return mesh_log


@pytest.fixture(scope="module")
def mesh(mesh_log):
    config = mesh_config(
        prefill=1,
        decode=2,
        transport="shm",
        decode_pacing_ms=40,  # streams last ~1 s: the faults land on streams in flight
        draft="ngram",
        log_level="info",  # the router logs each client it cuts off
        startup_timeout_s=300.0,
    )
    with launched(config, {**ENV, **CLIENT_ENV}, mesh_log.file) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def load():
    """Half short prompts (prefilled on the decode worker), half long ones (the prefill queue),
    and the offline engine's greedy text of each."""
    prompts = random_prompts(8, 16, 48, seed=33) + random_prompts(8, 200, 400, seed=34)
    return prompts, offline_texts(prompts, MAX_TOKENS)


def _metric(url: str, name: str) -> float:
    """The samples whose ``name{label="value",...}`` starts with ``name``, summed."""
    series = prom_text.series(prom_text.fetch(url, timeout_s=5))
    return sum(value for key, value in series.items() if key.startswith(name))


def _draft_contexts_left(mesh, timeout_s: float = 5.0) -> float:
    """The draft worker's sequences, once none is left or ``timeout_s`` ran out (a DraftForget
    may still be on its way when the last stream ends)."""
    deadline = time.monotonic() + timeout_s
    while (held := _metric(mesh.metrics_urls["draft-0"], "kvmesh_draft_sequences")) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    return held


def _no_death_concluded(log: str) -> None:
    """Nobody was dropped for silence, and no request was refused for want of a decode worker."""
    dropped = [line for line in log.splitlines() if "worker dropped" in line]
    assert not dropped, dropped
    assert "no decode worker is alive" not in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_stalled_clients_are_cut_off_and_stall_nothing_else(mesh, load, logged, capfd):
    prompts, expected = load
    stalled = random_prompts(20, 16, 48, seed=35)
    started = time.monotonic()
    result = asyncio.run(stalled_clients(mesh, stalled, 3000, prompts[:4], MAX_TOKENS, hold_s=10.0))
    took = time.monotonic() - started
    gaps = [o.worst_gap_s for o in result["normal"]]
    with capfd.disabled():
        print(
            f"\n20 stalled clients: {len(gaps)} normal streams, worst token gap {max(gaps):.3f} "
            f"s; /metrics worst {max(result['metrics_s']):.3f} s; blocks back "
            f"{result['blocks_back_s']} s after the clients closed ({took:.1f} s)"
        )
    # one normal stream after another, cycling over four prompts: each exactly right
    assert [(o.error, o.text) for o in result["normal"]] == [
        (None, expected[i % 4]) for i in range(len(result["normal"]))
    ]
    assert max(gaps) < 1.0
    assert max(result["metrics_s"]) < 1.0
    assert result["blocks_back_s"] is not None and result["blocks_back_s"] < 10
    router_metrics = mesh.metrics_urls["router-0"]
    assert _metric(router_metrics, "kvmesh_router_client_cutoffs_total") == 20
    # their draft contexts went with them
    assert _draft_contexts_left(mesh) == 0
    log = logged.new()
    assert log.count("client cut off") == 20, log[-3000:]  # one line each, nothing more
    assert "Error handling request" not in log, log[-3000:]
    _no_death_concluded(log)  # the router's heartbeats kept coming


@pytest.mark.parametrize("outage_s", [1.0, 10.0])
def test_streams_survive_a_killed_nats_server_restarted_after_an_outage(
    mesh, load, outage_s, logged, capfd
):
    """The load's streams are in flight at the kill; two more arrive halfway through the outage
    and wait for the mesh; the rest come after it."""
    prompts, expected = load
    started = time.monotonic()
    outcomes, back = asyncio.run(
        nats_outage(mesh, prompts[2:], MAX_TOKENS, CONCURRENCY, outage_s, during=prompts[:2])
    )
    counts = tally(outcomes, expected[2:] + expected[:2])
    with capfd.disabled():
        print(f"\nNATS down {outage_s:g} s: {counts.summary()}; blocks back {back} s", end=" ")
        print(f"({time.monotonic() - started:.1f} s)")
    assert counts.hung == 0 and counts.wrong == []
    assert counts.right_share >= 0.95
    assert back is not None and back < 10
    assert _draft_contexts_left(mesh) == 0
    assert "restarted nats-server" in capfd.readouterr().err  # by the supervisor
    _no_death_concluded(logged.new())  # nobody died of the outage


def test_placements_held_by_a_killed_registry_are_asked_of_the_next(mesh, load):
    prompts, expected = load
    retries = 'kvmesh_router_retries_total{role="kv-registry"}'
    asked_again = _metric(mesh.metrics_urls["router-0"], retries)
    started = time.monotonic()
    outcomes, back = asyncio.run(registry_kill(mesh, prompts[:4], MAX_TOKENS))
    counts = tally(outcomes, expected[:4])
    took = max(o.ended_at for o in outcomes if o is not None) - started
    print(f"\nregistry killed holding 4 placements: {counts.summary()} in {took:.1f} s")
    assert counts.right == 4  # none is a 504 "did not place the request"
    # each was asked again of the next registry (the dead one's placements are lost with it)
    assert _metric(mesh.metrics_urls["router-0"], retries) - asked_again >= 4
    assert back is not None and back < 10
    assert _draft_contexts_left(mesh) == 0


def test_streams_of_a_killed_decode_worker_migrate_and_leave_no_draft_context(mesh, load):
    """kill -9 of decode-0 at the load's first token: its streams with tokens migrate, those
    without run again (which of the two depends on where the load stood); either way each ends
    with the offline text."""
    router = mesh.metrics_urls["router-0"]
    roles = ('{role="decode-migrate"}', '{role="decode"}')

    def moved() -> float:
        return sum(_metric(router, f"kvmesh_router_retries_total{r}") for r in roles)

    before = moved()
    prompts, expected = load
    outcomes, back = asyncio.run(worker_kill(mesh, prompts, MAX_TOKENS, CONCURRENCY, "decode-0"))
    counts = tally(outcomes, expected)
    print(f"\ndecode-0 killed mid-stream: {counts.summary()}; blocks back {back} s")
    assert counts.hung == 0 and counts.wrong == []
    assert counts.right_share >= 0.95
    assert back is not None and back < 10  # decode-0 restarted by the supervisor, and decode-1
    assert moved() > before  # it held streams of the load
    assert _draft_contexts_left(mesh) == 0  # the moved sequences' contexts went


def test_no_reservation_outlives_its_request_after_a_decode_worker_is_stopped(mesh, load):
    prompts, expected = load
    outcomes, back = asyncio.run(decode_stop(mesh, prompts, MAX_TOKENS, CONCURRENCY, 6.0))
    counts = tally(outcomes, expected)
    print(f"\ndecode-0 stopped 6 s: {counts.summary()}; blocks back {back} s")
    assert counts.hung == 0 and counts.wrong == []
    assert back is not None and back < 10  # not a 30 s lease
    assert _draft_contexts_left(mesh) == 0
