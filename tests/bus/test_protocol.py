"""Every NATS message round-trips through the codec, and malformed payloads are refused with an
error that names the message type and the field."""

from __future__ import annotations

import msgspec
import orjson
import pytest
from kvmesh.shared.bus.messages.admin import (
    AdminControlled,
    AdminFailure,
    AdminLogLevel,
    AdminLogLevelSet,
    AdminStatus,
    AdminWorker,
    AdminWorkers,
    DecodeStatusRow,
    LeaseCounts,
    QueueStatus,
    RegistryInfo,
    StoreStatusRow,
    WorkerRow,
)
from kvmesh.shared.bus.messages.cache_events import KvCacheDigest, KvCacheEvents
from kvmesh.shared.bus.messages.codec import Message, MessageError, decode_message, encode_message
from kvmesh.shared.bus.messages.drafts import (
    DraftContext,
    DraftForget,
    DraftKvReserve,
    DraftKvReserveReply,
    DraftProposal,
)
from kvmesh.shared.bus.messages.kv_store import (
    StoreAck,
    StoreAdvert,
    StoreCommit,
    StoreCommitReply,
    StoreGet,
    StoreGetReply,
    StoreLoad,
    StorePut,
    StorePutReply,
    StoreReach,
    StoreRelease,
    StoreSolicit,
)
from kvmesh.shared.bus.messages.placement import (
    DecodeRankTarget,
    LeaseCancel,
    LeaseRenew,
    PlaceReply,
    PlaceRequest,
    ReserveReply,
    ReserveRequest,
)
from kvmesh.shared.bus.messages.prefill_jobs import (
    PrefillDone,
    PrefillJob,
    PrefillReport,
    PrefillStarted,
)
from kvmesh.shared.bus.messages.token_streams import (
    Abort,
    StreamHolder,
    StreamLookup,
    StreamReplay,
    StreamResume,
    TokenEvent,
)
from kvmesh.shared.bus.messages.workers import (
    BlockPool,
    DataPlaneRefusals,
    DecodeAdvert,
    DecodeReach,
    LogLevel,
    WorkerControl,
    WorkerGone,
    WorkerHeartbeat,
    WorkerLoad,
)
from kvmesh.shared.kv.descriptor import RdmaBackend, ShmBackend, TcpBackend, TransportDescriptor
from kvmesh.shared.kv.region import Access, MemoryRegion
from kvmesh.shared.text.sampling import SamplingOptions, TokenLogprobs
from support.adverts import with_fields
from support.nats_fuzz import message_types

SECRET = "ab" * 32  # a tcp descriptor's lane secret (64 hex digits)

SAMPLING = SamplingOptions(
    max_tokens=7,
    temperature=0.5,
    top_p=0.9,
    top_k=40,
    seed=-3,
    stop_token_ids=(2, 9),
    stop=("\n", "END"),
    ignore_eos=True,
)
DESCRIPTOR = TransportDescriptor(
    peer_id="decode-0",
    host_id="host-a",
    backends=(
        ShmBackend(socket="/tmp/kvmesh-1-deadbeef/notify.sock", table="kvmesh-1-deadbeef-table"),
        TcpBackend(host="10.0.0.2", port=41234, secret=SECRET, lanes=4),
        RdmaBackend(
            device="mlx5_0",
            port=1,
            lid=3,
            gid="fe80::1",
            gid_index=1,
            mtu=5,
            host="10.0.0.2",
            handshake_port=41235,
            iova={17: (4096, 1 << 40)},
            memory_windows=2,
            secret=SECRET,
        ),
    ),
    regions=(MemoryRegion(addr=1 << 32, length=1 << 20, rkey=17, access=1, lkey=5),),
)

RANK1 = DecodeRankTarget(78, (8192,), DESCRIPTOR, 4096)  # a TP decode worker's rank 1 (uneven)
JOB = PrefillJob(
    "r1",
    (1, 2),
    SAMPLING,
    "d0",
    "L1",
    DESCRIPTOR,
    77,
    (4096,),
    4096,
    1.5,
    router="rt-a1",
    ranks=(RANK1,),
)
PLACE = PlaceRequest(
    "r1", (1, 2, 3), SAMPLING, local_prefill=True, lease_ms=5, model_spec="L2:m", router="rt-a1"
)
ADVERT = DecodeAdvert(
    worker_id="d0",
    mode="disagg",
    reach=DecodeReach(
        descriptor=DESCRIPTOR,
        block_bytes=4096,
        block_size=16,
        kv_spec="4x2x64:f32",
        model_spec="L2:m",
        reads_kv_store=True,
        tp=2,
    ),
    load=WorkerLoad("ready", num_running=1, num_waiting=2),
    pool=BlockPool(total_blocks=10, free_blocks=7, free_block_ranges=((0, 3), (6, 10))),
    sent_at=1.5,
    refusals=DataPlaneRefusals(refused_accesses=1, stray_immediates=2, forged_announcements=3),
)

# One message of every type, every field set to something other than its default.
STORE_ADVERT = StoreAdvert(
    store_id="s0",
    reach=StoreReach(
        descriptor=DESCRIPTOR, kv_spec="L2:m", block_bytes=4096, block_size=16, epoch="e1"
    ),
    load=StoreLoad(
        state="draining",
        total_blocks=10,
        used_blocks=4,
        pinned_blocks=1,
        hits=5,
        misses=2,
        evictions=1,
        bytes_written=8192,
        bytes_read=4096,
        refused_accesses=3,
        disk_total_blocks=40,
        disk_used_blocks=6,
        disk_hits=2,
        disk_evictions=1,
    ),
    sent_at=2.0,
)
WORKER_ROW = WorkerRow("p0", "prefill", WorkerLoad("ready", 1, 2), last_seen_s=0.5, tp=2)

EXAMPLES: list[Message] = [
    PLACE,
    ReserveRequest(
        "r1", (1, 2), SAMPLING, local_prefill=True, lease_id="L1", lease_ms=9, router="rt-a1"
    ),
    ReserveReply(
        ok=True,
        worker_id="d0",
        block_ids=(4, 5),
        error="e",
        rkey=77,
        block_addrs=(1 << 32,),
        ranks=(RANK1,),
    ),
    RANK1,
    PlaceReply(
        ok=True,
        request_id="r1",
        worker_id="d0",
        lease_id="L1",
        descriptor=DESCRIPTOR,
        rkey=77,
        block_ids=(4, 5),
        block_addrs=(4096, 8192),
        block_bytes=4096,
        error="e",
        retry_after_s=0.25,
        local_prefill=True,
        cached_tokens=32,
        ranks=(RANK1,),
    ),
    JOB,
    PrefillDone(
        "r1",
        "L1",
        ok=True,
        first_token=5,
        num_writes=3,
        error="e",
        rkey=77,
        draft_worker_id="dr0",
        first_logprobs=TokenLogprobs(-0.5, (5, 2), (-0.5, -1.25)),
        prompt_logprobs=(TokenLogprobs(-1.5, rank=3),),
    ),
    PrefillReport("r1", "p0", 0.1, 0.2, 0.3, 0.04, num_chunks=2),
    TokenEvent(
        "r1",
        (5, 6),
        "length",
        num_prompt_tokens=3,
        num_output_tokens=2,
        error="e",
        num_accepted_drafts=1,
        wait_s=0.5,
        prefill_s=1.25,
        logprobs=(TokenLogprobs(-0.5), TokenLogprobs(-2.0, (1,), (-0.125,))),
        index=2,
        prompt_logprobs=(TokenLogprobs(-1.5, rank=3),),
    ),
    Abort("r1", reason="lease expired", job_withdrawn=True),
    PrefillStarted("r1", "L1", "p0"),
    WorkerGone("router-0", "router", last_seen_s=3.5, instance="rt-a1"),
    LeaseRenew("r1", "L1", lease_ms=1000),
    LeaseCancel("r1", "L1", reason="no reserve reply within 2s"),
    WorkerHeartbeat(
        worker_id="d0",
        role="decode",
        load=WorkerLoad("draining", num_running=2, num_waiting=1),
        started_at=1.0,
        sent_at=2.0,
        instance="i1",
        interval_s=2.0,
        tp=2,
    ),
    ADVERT,
    WorkerControl("drain"),
    StoreSolicit("prefill-1"),
    LogLevel("debug"),
    KvCacheEvents("d0", epoch="e1", seq=3, stored=(2**64 - 1, 7), removed=(9,)),
    KvCacheDigest("d0", epoch="e1", seq=4, hashes=(7, 2**63), num_cached_blocks=5),
    StreamLookup("cmpl-1"),
    StreamHolder("d0", wire_id="cmpl-1-m2", expired=True),
    StreamResume("cmpl-1-m2", router="rt-a2", num_prompt_tokens=3),
    StreamReplay(
        events=(TokenEvent("cmpl-1-m2", (4,), num_output_tokens=1),),
        prior_token_ids=(7, 8),
        error="e",
    ),
    DraftContext(
        "r1", "d0", start=12, token_ids=(5, 6), num_prompt_tokens=10, num_verified=4, num_accepted=3
    ),
    DraftProposal(
        "r1", "dr0", position=14, tokens=(7, 8, 9), parents=(-1, 0, 0), need_context=True, depth=2
    ),
    DraftForget("r1"),
    DraftKvReserve("r1", "L1", prompt_ids=(1, 2), kv_spec="L2:m", lease_ms=9, draft_kv_spec="L1:d"),
    DraftKvReserveReply(
        ok=True,
        worker_id="dr0",
        descriptor=DESCRIPTOR,
        rkey=77,
        block_addrs=(4096,),
        block_bytes=4096,
        num_layers=1,
        error="e",
        whole_blocks=True,
    ),
    StorePut("p0", "L2:m", (7, 2**63), lease_ms=9),
    StorePutReply(
        ok=True,
        store_id="s0",
        put_id="u1",
        rkey=77,
        present=(7,),
        write_hashes=(2**63,),
        block_addrs=(4096,),
        header_addrs=(64,),
        block_bytes=4096,
        error="e",
        retry_after_s=0.5,
    ),
    StoreCommit("u1", rkey=77),
    StoreCommitReply(ok=True, committed=(7,), rejected=(8,), error="e"),
    StoreGet("d0", "L2:m", (7, 8), lease_ms=9),
    StoreGetReply(
        ok=True,
        store_id="s0",
        get_id="g1",
        rkey=78,
        block_hashes=(7,),
        block_addrs=(4096,),
        header_addrs=(64,),
        block_bytes=4096,
        error="e",
    ),
    StoreRelease("g1", rkey=78),
    StoreAck(ok=True, error="e"),
    STORE_ADVERT,
    AdminWorker("d0"),
    AdminLogLevel("debug"),
    AdminFailure("no worker 'x'"),
    AdminWorkers((WORKER_ROW,)),
    AdminControlled(ok=True, worker="d0", action="drain", state="draining"),
    AdminLogLevelSet(ok=True, level="debug"),
    AdminStatus(
        decode=(
            DecodeStatusRow(
                "d0",
                "decode",
                load=WorkerLoad("ready", 1, 2),
                pool=BlockPool(64, 60),
                free_blocks_estimate=58,
                leases=1,
                cached_blocks=8,
                cache_synced=True,
                reach=ADVERT.reach,
                refusals=ADVERT.refusals,
                last_seen_s=0.5,
            ),
        ),
        workers=(WORKER_ROW,),
        leases=LeaseCounts(active=1, granted=9, completed=7, expired=1, dropped=1),
        stores=(
            StoreStatusRow(
                "s0",
                load=STORE_ADVERT.load,
                reach=STORE_ADVERT.reach,
                capacity_bytes=65536,
                used_bytes=8192,
                disk_capacity_bytes=32768,
                disk_used_bytes=4096,
                hit_rate=0.625,
                indexed_blocks=8,
                index_synced=True,
                last_seen_s=0.25,
            ),
        ),
        registry=RegistryInfo("reg-0", "m", uptime_s=12.5, worker_timeout_s=3.0),
        prefill_queue=QueueStatus(depth=2, workers=1, note="electing"),
        degraded=("kv-store (s1 silent)",),
    ),
]


def _message_types() -> set[type]:
    return set(message_types())


def _id(msg: Message) -> str:
    return type(msg).__name__


def _wire(msg: Message) -> dict:
    return orjson.loads(encode_message(msg))


def test_examples_cover_every_message_type():
    assert {type(m) for m in EXAMPLES} == _message_types()


@pytest.mark.parametrize("msg", EXAMPLES, ids=_id)
def test_round_trip_preserves_every_field_when_none_is_default(msg):
    for field in msgspec.structs.fields(msg):
        if field.default is not msgspec.NODEFAULT:
            assert getattr(msg, field.name) != field.default, field.name
    assert decode_message(encode_message(msg), type(msg)) == msg


def test_defaults_fill_missing_optional_fields():
    assert decode_message(b'{"ok": false, "request_id": "x"}', PlaceReply) == PlaceReply(False, "x")


def test_round_trip_of_a_colocated_advert_without_descriptor():
    advert = with_fields(ADVERT, descriptor=None, mode="colocated")
    assert decode_message(encode_message(advert), DecodeAdvert) == advert


# --- refusals ----------------------------------------------------------------------------------


def _first_field(msg: Message) -> str:
    return msgspec.structs.fields(msg)[0].name


@pytest.mark.parametrize("msg", EXAMPLES, ids=_id)
def test_decode_refuses_a_field_of_the_wrong_type_naming_it(msg):
    name = _first_field(msg)
    wire = _wire(msg)
    wire[name] = {"not": "this"}
    with pytest.raises(MessageError, match=rf"^{_id(msg)}\.{name}: expected \w+, got object"):
        decode_message(orjson.dumps(wire), type(msg))


@pytest.mark.parametrize("msg", EXAMPLES, ids=_id)
def test_decode_refuses_a_value_nested_in_extra_lists(msg):
    name = _first_field(msg)
    wire = _wire(msg)
    wire[name] = [[wire[name]]]
    with pytest.raises(MessageError, match=rf"^{_id(msg)}\.{name}(\[0\])*: expected"):
        decode_message(orjson.dumps(wire), type(msg))


@pytest.mark.parametrize(
    "msg", [m for m in EXAMPLES if any(f.required for f in msgspec.structs.fields(m))], ids=_id
)
def test_decode_refuses_a_missing_required_field_naming_it(msg):
    name = _first_field(msg)
    wire = _wire(msg)
    del wire[name]
    with pytest.raises(MessageError, match=rf"^{_id(msg)}: missing field '{name}'$"):
        decode_message(orjson.dumps(wire), type(msg))


@pytest.mark.parametrize("msg", EXAMPLES, ids=_id)
def test_decode_refuses_an_unknown_field(msg):
    wire = {**_wire(msg), "bogus": 1}
    with pytest.raises(MessageError, match=rf"^{_id(msg)}: unknown field 'bogus'$"):
        decode_message(orjson.dumps(wire), type(msg))


def test_decode_names_the_index_of_a_wrong_item():
    with pytest.raises(MessageError, match=r"^TokenEvent\.token_ids\[1\]: expected int, got str$"):
        decode_message(b'{"request_id": "r", "token_ids": [1, "2"]}', TokenEvent)


def test_decode_refuses_bad_json_and_a_body_that_is_not_an_object():
    with pytest.raises(MessageError, match=r"^Abort: body is not JSON"):
        decode_message(b"{nope", Abort)
    with pytest.raises(MessageError, match=r"^Abort: expected object, got array$"):
        decode_message(b'["r"]', Abort)


def test_decode_refuses_sampling_outside_its_bounds():
    with pytest.raises(MessageError, match=r"^PlaceRequest\.sampling\.top_k: expected int >= 0$"):
        raw = _wire(PLACE)
        raw["sampling"]["top_k"] = -1
        decode_message(orjson.dumps(raw), PlaceRequest)


def test_encode_refuses_what_is_not_a_message():
    with pytest.raises(AssertionError):
        encode_message({"request_id": "r"})  # type: ignore[arg-type]


# --- the transport descriptor ------------------------------------------------------------------


def test_descriptor_backends_are_tagged_on_the_wire():
    wire = _wire(JOB)["descriptor"]
    assert [b["backend"] for b in wire["backends"]] == ["shm", "tcp", "rdma"]
    assert DESCRIPTOR.backend("tcp") == TcpBackend(
        host="10.0.0.2", port=41234, secret=SECRET, lanes=4
    )
    assert DESCRIPTOR.backend("nvlink") is None


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"backend": "ftp"}, r"descriptor\.backends\[1\]\.backend: invalid value 'ftp'"),
        ({"port": 0}, r"descriptor\.backends\[1\]\.port: expected int >= 1"),
        ({"port": "22"}, r"descriptor\.backends\[1\]\.port: expected int, got str"),
        ({"path": "/etc/shadow"}, r"descriptor\.backends\[1\]: unknown field 'path'"),
    ],
)
def test_descriptor_with_an_unknown_backend_or_bad_field_is_refused(change, match):
    wire = _wire(JOB)
    wire["descriptor"]["backends"][1].update(change)
    with pytest.raises(MessageError, match=rf"^PrefillJob\.{match}"):
        decode_message(orjson.dumps(wire), PrefillJob)


def test_descriptor_hands_each_backend_its_typed_part_and_regions():
    assert DESCRIPTOR.backend_names == ("shm", "tcp", "rdma")
    assert DESCRIPTOR.backend("tcp") == TcpBackend("10.0.0.2", 41234, SECRET, lanes=4)
    rdma = DESCRIPTOR.backend("rdma")
    assert rdma is not None and rdma.iova == {17: (4096, 1 << 40)} and rdma.memory_windows == 2
    back = decode_message(encode_message(_with(DESCRIPTOR)), PrefillJob).descriptor
    assert back == DESCRIPTOR
    region = back.region(17)
    assert (region.addr, region.lkey) == (1 << 32, 5) and region.access is Access.REMOTE_WRITE


def test_public_descriptor_drops_region_keys_unless_rdma_binds_no_memory_windows():
    assert DESCRIPTOR.public().regions == () and DESCRIPTOR.public().backends == DESCRIPTOR.backends
    tcp_only = msgspec.structs.replace(DESCRIPTOR, backends=(DESCRIPTOR.backend("tcp"),))
    assert tcp_only.public().regions == ()
    no_mw = msgspec.structs.replace(DESCRIPTOR.backend("rdma"), memory_windows=0)
    rdma_only = msgspec.structs.replace(DESCRIPTOR, backends=(no_mw,))
    assert rdma_only.public() == rdma_only  # there a window's key is the region's own


async def test_descriptor_of_a_real_rdma_transport_round_trips():
    from kvmesh.shared.transport import TransportConfig
    from kvmesh.shared.transport.rdma import RdmaTransport
    from support.fake_pyverbs import FakeVerbs

    async with RdmaTransport(TransportConfig(), verbs=FakeVerbs()) as transport:
        transport.register(transport.allocate(4096), Access.REMOTE_WRITE)
        descriptor = transport.descriptor()
        assert descriptor.backend_names == ("rdma",) and len(descriptor.regions) == 1
        assert (
            decode_message(encode_message(_with(descriptor)), PrefillJob).descriptor == descriptor
        )


async def test_descriptor_of_real_tcp_and_shm_transports_round_trips():
    from kvmesh.shared.transport import TransportConfig
    from kvmesh.shared.transport.shm import ShmTransport
    from kvmesh.shared.transport.tcp import TcpTransport

    for kind in (TcpTransport, ShmTransport):
        async with kind(TransportConfig()) as transport:
            transport.register(transport.allocate(4096), Access.REMOTE_WRITE)
            descriptor = transport.descriptor()
            assert len(descriptor.regions) == 1
            assert (
                decode_message(encode_message(_with(descriptor)), PrefillJob).descriptor
                == descriptor
            )


def _with(descriptor: TransportDescriptor) -> PrefillJob:
    return msgspec.structs.replace(JOB, descriptor=descriptor)


# --- model identity ----------------------------------------------------------------------------


def test_model_spec_is_what_router_and_decode_both_compute_and_tells_models_apart():
    """The router reads only the config; a decode worker loads the weights, maybe in another
    dtype: both get the same model_spec. Another shape gets another."""
    import torch
    from kvmesh.shared.model.identity import model_spec
    from kvmesh.shared.model.loader import load_config_and_tokenizer
    from kvmesh.shared.model.seeded import SeededShape

    router_config, _ = load_config_and_tokenizer("kvmesh-tiny")
    decode_config, _ = load_config_and_tokenizer("kvmesh-tiny", torch.bfloat16)
    assert model_spec(router_config) == model_spec(decode_config)
    mc = router_config
    assert model_spec(mc).startswith(
        f"L{mc.num_hidden_layers}-H{mc.num_key_value_heads}-D{mc.head_dim}:model-"
    )
    assert model_spec(SeededShape().config()) != model_spec(router_config)
