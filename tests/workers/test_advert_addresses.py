"""No advert carries a memory address (issue 40, low: the decode advert broadcast ``base_addr``).

A disaggregated decode worker with its KV pool registered on a real tcp transport advertises as
the service does: no number in the advert falls inside its region, and no field is named for an
address. Its blocks' addresses go only in a reservation's reply, beside the lease's window key."""

from __future__ import annotations

from typing import Any

import msgspec
import orjson
from kvmesh.shared.bus.messages.kv_store import StoreAdvert
from kvmesh.shared.bus.messages.placement import ReserveRequest
from kvmesh.shared.bus.messages.workers import DecodeAdvert
from kvmesh.shared.text.sampling import SamplingOptions


class Published:
    def __init__(self) -> None:
        self.messages: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.messages.append((subject, data))


def numbers_in(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, dict):
        return [n for v in value.values() for n in numbers_in(v)]
    if isinstance(value, list):
        return [n for v in value for n in numbers_in(v)]
    return []


def field_names(cls: type) -> list[str]:
    """Every field of a message type, its parts' too (``reach.descriptor``)."""
    names = []
    for f in msgspec.structs.fields(cls):
        names.append(f.name)
        if isinstance(f.type, type) and issubclass(f.type, msgspec.Struct):
            names += [f"{f.name}.{n}" for n in field_names(f.type)]
    return names


def test_no_advert_type_has_an_address_field() -> None:
    for advert in (DecodeAdvert, StoreAdvert):
        names = field_names(advert)
        assert "reach.block_bytes" in names or advert is StoreAdvert  # the parts are walked
        assert not [n for n in names if "addr" in n], (advert.__name__, names)


async def test_the_decode_advert_names_no_address_of_its_region_the_reservation_does(tiny):
    from kvmesh.services.decode.config import DecodeConfig
    from kvmesh.services.decode.service import DecodeService
    from kvmesh.services.decode.worker import DecodeWorker
    from kvmesh.shared.bus.messages.workers import DecodeReach
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.transport import Access, TransportConfig, create_transport

    engine = LLMEngine(*tiny, EngineConfig(num_blocks=16))
    spec = engine.kv_pool.spec
    async with create_transport("tcp", TransportConfig(peer_id="d0")) as transport:
        region = transport.register(engine.kv_pool.raw, Access.REMOTE_WRITE)
        worker = DecodeWorker(engine, worker_id="d0", base_addr=region.addr)
        reach = DecodeReach(
            descriptor=transport.descriptor().public(),
            block_bytes=spec.block_bytes,
            block_size=spec.block_size,
            kv_spec=engine.kv_spec,
            model_spec="m",
            reads_kv_store=False,
        )
        nc = Published()
        service = DecodeService(DecodeConfig(), worker, transport, nc, reach=reach)  # type: ignore[arg-type]
        await service.advertise()
        ((subject, data),) = nc.messages
        assert subject == DecodeConfig().subjects.REGISTRY_ADVERTISE
        advert = orjson.loads(data)
        inside = [n for n in numbers_in(advert) if region.addr <= n < region.addr + region.length]
        assert not inside, f"the advert carries addresses of the region: {inside}"

        opts = SamplingOptions(max_tokens=4, temperature=0.0)
        request = ReserveRequest("r", tuple(range(1, 41)), opts, False, "Lr", 1000)
        reply = await worker.reserve(request)
        assert reply.ok and reply.block_addrs == tuple(
            region.addr + b * spec.block_bytes for b in reply.block_ids
        )
