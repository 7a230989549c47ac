"""A prefill worker borrows decode's cores while decode is idle (services/prefill/core_loan.py):
the decision from decode's adverts, and the loan's threads and affinity around one step."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from kvmesh.services.prefill.config import PrefillConfig
from kvmesh.services.prefill.core_loan import CoreLoan, DecodeIdleness, HeardLoad
from support.adverts import with_fields


def test_decode_is_idle_when_every_fresh_advert_says_nothing_runs() -> None:
    idleness = DecodeIdleness(max_age_s=3.0, settle_s=0.25)
    assert not idleness.idle([], now=10.0)  # no decode worker heard: nothing known
    assert idleness.idle([HeardLoad("d1", 9.0, 0)], now=10.0)
    assert not idleness.idle([HeardLoad("d1", 9.0, 2)], now=10.0)
    assert not idleness.idle([HeardLoad("d1", 9.0, 0), HeardLoad("d2", 9.5, 1)], now=10.0)
    # an advert older than max_age_s is a worker gone: it neither blocks nor allows a loan
    assert idleness.idle([HeardLoad("d1", 9.0, 0), HeardLoad("gone", 2.0, 5)], now=10.0)
    assert not idleness.idle([HeardLoad("gone", 2.0, 0)], now=10.0)


def test_a_delivery_blocks_the_loan_until_an_advert_heard_after_it_counts_its_stream() -> None:
    idleness = DecodeIdleness(max_age_s=3.0, settle_s=0.25)
    idleness.delivered("d1", now=10.0)
    assert not idleness.idle([HeardLoad("d1", 9.9, 0)], now=10.1)  # heard before the delivery
    assert not idleness.idle([HeardLoad("d1", 10.1, 0)], now=10.2)  # too soon: may not count it
    assert idleness.idle([HeardLoad("d1", 10.3, 0)], now=10.4)  # its stream already ended
    assert not idleness.idle([HeardLoad("d1", 10.3, 1)], now=10.4)
    # a delivery to another decode worker does not hold this one's advert back
    assert idleness.idle([HeardLoad("d2", 10.05, 0)], now=10.1)


def test_a_loan_needs_cores_of_its_own_and_one_more_to_borrow() -> None:
    with pytest.raises(ValueError, match="needs --cpus"):
        CoreLoan(frozenset(), frozenset({1}), 1)
    with pytest.raises(ValueError, match="adds no CPU"):
        CoreLoan(frozenset({0, 1}), frozenset({1}), 2)
    loan = CoreLoan(frozenset({0}), frozenset({1, 2}), 1)
    assert loan.widened_threads == 3
    assert loan.describe() == "borrows CPUs 1-2 while decode is idle (3 threads then)"
    with pytest.raises(ValueError, match="needs --cpus"):
        PrefillConfig(borrow_cpus="1")
    with pytest.raises(ValueError, match="adds no CPU"):
        PrefillConfig(cpus="0", borrow_cpus="0")
    config = PrefillConfig(cpus="0", borrow_cpus="1", threads=1)
    assert config.core_loan(frozenset({0})) == CoreLoan(frozenset({0}), frozenset({1}), 1)
    assert PrefillConfig(cpus="0").core_loan(frozenset({0})) is None


CHILD = """
import os, threading, torch
from kvmesh.services.prefill.core_loan import CoreLoan, pin_threads
own, extra = int(os.environ["OWN"]), int(os.environ["EXTRA"])
os.sched_setaffinity(0, {own})
torch.set_num_threads(1)
helper = threading.Thread(target=threading.Event().wait, args=(5,), daemon=True)
helper.start()  # a thread that exists before the loan (as torch's and asyncio's do)
loan = CoreLoan(frozenset({own}), frozenset({extra}), 1)

def allowed():
    return {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}

def step():
    torch.ones(256, 256) @ torch.ones(256, 256)  # torch's own threads start under the loan
    return torch.get_num_threads(), allowed()

print(loan.run(False, step)[0])
threads, during = loan.run(True, step)
print(threads, all(cpus == sorted({own, extra}) for cpus in during.values()))
print(torch.get_num_threads(), all(cpus == [own] for cpus in allowed().values()))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to lend one")
def test_a_loan_widens_every_thread_for_one_step_and_puts_them_back() -> None:
    own, extra = sorted(os.sched_getaffinity(0))[:2]
    env = {**os.environ, "OWN": str(own), "EXTRA": str(extra)}
    run = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, env=env
    )
    assert run.stdout.split("\n")[:3] == ["1", "2 True", "1 True"]


class RecordingLoan:
    """A loan that runs the step as is and records whether it was asked to widen."""

    def __init__(self) -> None:
        self.widened: list[bool] = []

    def run(self, widen, step):
        self.widened.append(widen)
        return step()


async def test_the_worker_borrows_for_steps_while_decode_is_idle_and_not_after_a_delivery(tiny):
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from support.prefill_rig import prefill_job, prefill_rig

    engine = LLMEngine(*tiny, EngineConfig(num_blocks=64, max_num_batched_tokens=32))
    loan = RecordingLoan()

    def prompt(seed):  # three chunks of at most 32 tokens, none a prefix of another's
        return [(7 * i + seed) % 250 + 1 for i in range(60)]

    async with prefill_rig(engine, kv_spec="s", loan=loan) as (worker, _, region, _):
        advert = worker.adverts.get("d0")
        assert (
            await worker.prefill(prefill_job(worker, "a", prompt(0), region, [0, 1, 2, 3]))
        ).done.ok
        assert loan.widened == [True] * 3  # "d0" advertised itself idle, and stays so
        assert worker.metrics.borrowed_steps._value.get() == 3
        # "a" now decodes on d0: until an advert heard after the delivery counts it, no loan
        assert (
            await worker.prefill(prefill_job(worker, "b", prompt(1), region, [4, 5, 6, 7]))
        ).done.ok
        assert loan.widened[3:] == [False] * 3
        worker.idleness.settle_s = 0.0
        worker.adverts.note(with_fields(advert, num_running=1))
        assert (
            await worker.prefill(prefill_job(worker, "c", prompt(2), region, [8, 9, 10, 11]))
        ).done.ok
        assert loan.widened[6:] == [False] * 3  # d0 decodes a stream
        worker.adverts.note(advert)  # its streams ended
        assert (
            await worker.prefill(prefill_job(worker, "d", prompt(3), region, [12, 13, 14, 15]))
        ).done.ok
        assert loan.widened[9:] == [True] * 3
        assert worker.metrics.borrowed_steps._value.get() == 6
