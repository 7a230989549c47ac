"""Worker features (shared/bus/worker_feature.py): a feature is one class of its own and one
line in the composition (services/decode/compose.py, services/prefill/compose.py). The features
here are added exactly that way, as a reviewer would add one (the test's own module stands for
the feature's; the factories it composes with are FEATURES plus its one line), and nothing else
changes: the decode service subscribes its routes, sends its messages after each step, carries
its advert fields and closes it; the prefill worker tells it of each job, the service announces
what it returns before the decode worker's PrefillDone, and closes it. The draft-KV feature's
NATS side (draft_reserve.py) gives back a reservation its job never wrote into."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from kvmesh.services.decode.step_hooks import Step, StepHook
from kvmesh.services.prefill.job_hooks import JobHook
from kvmesh.shared.bus.messages.codec import decode_message, encode_message
from kvmesh.shared.bus.messages.drafts import DraftForget, DraftKvReserveReply
from kvmesh.shared.bus.messages.placement import ReserveRequest
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone
from kvmesh.shared.bus.messages.token_streams import TokenEvent
from kvmesh.shared.bus.messages.workers import DecodeAdvert, WorkerGone
from kvmesh.shared.bus.worker_feature import Feature, Features, Site
from kvmesh.shared.text.sampling import SamplingOptions
from support.prefill_rig import prefill_job, prefill_rig


class FakeNats:
    """Records what is published; answers requests with ``reply`` (a message)."""

    def __init__(self, reply=None) -> None:
        self.published: list[tuple[str, bytes]] = []
        self.reply = reply
        self.requests: list[str] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.published.append((subject, data))

    async def request(self, subject: str, data: bytes, timeout: float):
        self.requests.append(subject)

        class Answer:
            pass

        answer = Answer()
        answer.data = encode_message(self.reply)
        return answer


closed: list[str] = []  # features closed, in order


class Finished(StepHook):
    """A decode feature: after each step, a DraftForget per finished request to
    ``draft_forget("tally")``; it hears of gone workers, advertises that it reads a kv-store
    (any field of the advert's reach will do) and notes when it is closed."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.queued: list[DraftForget] = []
        self.gone: list[str] = []

    @classmethod
    def compose(cls, parts) -> Finished:
        return cls(parts.worker_id)

    def after_step(self, engine, step: Step) -> None:
        self.queued += [DraftForget(out.request_id) for out, _ in step.finished()]

    async def _on_gone(self, msg: WorkerGone) -> None:
        self.gone.append(msg.worker_id)

    def routes(self, site: Site):
        return ((site.subjects.REGISTRY_WORKER_GONE, WorkerGone, self._on_gone),)

    def outbox(self, subjects):
        out, self.queued = self.queued, []
        return [(subjects.draft_forget("tally"), msg) for msg in out]

    def advert(self):
        return {"reads_kv_store": True}

    async def aclose(self) -> None:
        closed.append("finished")


class Closing(Feature):
    """Not a step hook: composed before ``Finished``, so closed after it."""

    @classmethod
    def compose(cls, parts) -> Closing:
        return cls()

    async def aclose(self) -> None:
        closed.append("closing")


async def test_a_decode_feature_added_in_one_line_is_wired_sent_advertised_and_closed(tiny):
    from kvmesh.services.decode.compose import FEATURES, DecodeParts, compose_features
    from kvmesh.services.decode.config import DecodeConfig
    from kvmesh.services.decode.metrics import DecodeMetrics
    from kvmesh.services.decode.service import DecodeService
    from kvmesh.services.decode.worker import DecodeWorker
    from kvmesh.shared.bus.messages.workers import DecodeReach
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    config = DecodeConfig(mode="colocated")
    engine = LLMEngine(*tiny, EngineConfig(num_blocks=64))
    nc, lock = FakeNats(), asyncio.Lock()
    parts = DecodeParts(config, engine, "d0", nc, None, None, DecodeMetrics(), lock)
    features = compose_features(parts, (*FEATURES, Closing.compose, Finished.compose))
    finished = features.features.of_type(Finished)[0]
    assert features.hooks[-1] is finished  # a step hook; Closing is not
    worker = DecodeWorker(engine, worker_id="d0", base_addr=0, hooks=features.hooks, lock=lock)
    spec = engine.kv_pool.spec
    reach = DecodeReach(None, spec.block_bytes, spec.block_size, engine.kv_spec, "m", False)
    service = DecodeService(config, worker, None, nc, features=features.features, reach=reach)

    site = Site(nc, config.subjects, "d0")
    routes = {(subject, kind): handle for subject, kind, handle in service.features.routes(site)}
    await routes[(config.subjects.REGISTRY_WORKER_GONE, WorkerGone)](WorkerGone("x", "draft", 1.0))
    assert finished.gone == ["x"]

    opts = SamplingOptions(max_tokens=3, temperature=0.0)
    assert (
        await worker.reserve(ReserveRequest("a", tuple(range(1, 11)), opts, True, "L", 1000))
    ).ok
    forget_subject = config.subjects.draft_forget("tally")

    async def until_sent() -> None:
        while forget_subject not in [s for s, _ in nc.published]:
            await asyncio.sleep(0.01)

    loop = asyncio.create_task(service.engine_loop())
    try:
        await asyncio.wait_for(until_sent(), 60)
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
    subjects = [s for s, _ in nc.published]
    final = subjects.index(forget_subject)
    token_subject = config.subjects.request_tokens("a")
    assert subjects[:final] == [token_subject] * final  # sent after the step that ended "a"
    last = decode_message(nc.published[final - 1][1], TokenEvent)
    assert last.finish_reason == "length"
    assert decode_message(nc.published[final][1], DraftForget).request_id == "a"

    nc.published.clear()
    await service.advertise()
    ((subject, data),) = nc.published
    assert subject == config.subjects.REGISTRY_ADVERTISE
    assert decode_message(data, DecodeAdvert).reach.reads_kv_store  # the feature's field

    closed.clear()
    await service.features.aclose()
    assert closed == ["finished", "closing"]  # the last composed first


def test_two_features_setting_one_advert_field_is_a_composition_error():
    class Reads(Feature):
        def advert(self):
            return {"reads_kv_store": True}

    with pytest.raises(ValueError, match="reads_kv_store"):
        Features([Reads(), Reads()]).advert()


class Announcing(JobHook):
    """A prefill feature: notes each job it is told of, announces its end to worker "w-1"."""

    def __init__(self) -> None:
        self.received: list[str] = []

    @classmethod
    def compose(cls, parts) -> Announcing:
        return cls()

    def on_received(self, msg) -> None:
        self.received.append(msg.request_id)

    def finish(self, msg, job, ok, error):
        return ("w-1", PrefillDone(msg.request_id, msg.lease_id, ok, rkey=7))

    async def aclose(self) -> None:
        closed.append("announcing")


async def test_a_prefill_feature_added_in_one_line_is_told_of_jobs_announced_and_closed(tiny):
    from kvmesh.services.prefill.compose import FEATURES, PrefillParts, compose_features
    from kvmesh.services.prefill.config import PrefillConfig
    from kvmesh.services.prefill.metrics import PrefillMetrics
    from kvmesh.services.prefill.service import PrefillService
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    config = PrefillConfig(use_kv_store=False)
    engine = LLMEngine(*tiny, EngineConfig(num_blocks=64, max_num_batched_tokens=32))
    nc, lock = FakeNats(), asyncio.Lock()
    parts = PrefillParts(
        config, engine, "p0", "spec-a", nc, None, None, None, PrefillMetrics(), lock
    )  # the data plane is the rig's; no feature this config turns on needs it
    features = compose_features(parts, (*FEATURES, Announcing.compose))
    (hook,) = features.hooks
    prompt = [(3 * i) % 250 + 1 for i in range(40)]
    async with prefill_rig(engine, kv_spec="spec-a", hooks=features.hooks, lock=lock) as rig:
        worker, _, region, _ = rig
        async with asyncio.TaskGroup() as tg:
            service = PrefillService(config, worker, nc, tg, features.features)
            await service._run_job(prefill_job(worker, "r", prompt, region, range(3)))
    assert hook.received == ["r"]
    subjects = [s for s, _ in nc.published]
    s = config.subjects
    assert subjects == [
        s.draft_kv_done("w-1"),
        s.decode_prefill_done("d0"),
        s.request_prefill_report("r"),
    ]
    assert decode_message(nc.published[0][1], PrefillDone).rkey == 7
    closed.clear()
    await service.features.aclose()
    assert closed == ["announcing"]


async def test_a_draft_kv_reservation_its_job_never_wrote_into_is_given_back(tiny):
    """The draft-KV feature asks for blocks when a job arrives; the job is refused (no advert
    of its decode worker), so the reservation goes back as "not written"."""
    from kvmesh.services.prefill.draft_reserve import DraftReservations
    from kvmesh.services.prefill.draft_writes import DraftKv
    from kvmesh.services.prefill.metrics import PrefillMetrics
    from kvmesh.shared.config.subjects import Subjects
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    subjects = Subjects("m")
    reply = DraftKvReserveReply(True, "x1", rkey=5)
    nc, lock = FakeNats(reply), asyncio.Lock()
    engine = LLMEngine(*tiny, EngineConfig(num_blocks=64, max_num_batched_tokens=32))
    prompt = [(5 * i) % 250 + 1 for i in range(40)]  # two full blocks and a partial one
    async with prefill_rig(engine, kv_spec="spec-a", lock=lock) as (worker, _, region, _):
        draft_kv = DraftKv(
            engine, worker.region, worker.endpoints, PrefillMetrics(), lock, None, None,
            DraftReservations(nc, subjects, "spec-a", ""),
        )  # fmt: skip
        worker.hooks = (draft_kv,)
        job = prefill_job(worker, "q", prompt, region, range(3), descriptor="nobody")
        result = await worker.prefill(job)
        assert not result.done.ok and result.draft_done is None
        await draft_kv.aclose()  # the give-back is under way: wait for it
    assert nc.requests == [subjects.DRAFT_KV_RESERVE]
    ((subject, data),) = nc.published
    assert subject == subjects.draft_kv_done("x1")
    given_back = decode_message(data, PrefillDone)
    assert (given_back.request_id, given_back.ok, given_back.error, given_back.rkey) == (
        "q", False, "not written", 5,
    )  # fmt: skip
