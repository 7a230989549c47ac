"""What tests/bus/test_nats_fuzz.py sends: every subject some role reads, generated from
``Subjects`` and the roles' permissions (shared/bus/nats_auth.py), each with bodies generated from
the protocol's message types (``msgspec.inspect``), and which role may publish it."""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import random
from collections.abc import Iterator
from typing import Any

import msgspec
from kvmesh.shared.bus import messages
from kvmesh.shared.bus.messages.codec import Message
from kvmesh.shared.bus.nats_auth import ADMIN, role_permissions
from kvmesh.shared.config.subjects import Subjects

NOT_SUBJECTS = {"mesh", "prefix", "PREFILL_STREAM", "status"}
REQUEST_ID = "fuzz-request"


def matches(pattern: str, subject: str) -> bool:
    """NATS wildcard match: ``*`` one token, ``>`` one or more trailing tokens."""
    pat, sub = pattern.split("."), subject.split(".")
    for i, token in enumerate(pat):
        if token == ">":
            return len(sub) > i
        if i >= len(sub) or (token != "*" and token != sub[i]):
            return False
    return len(pat) == len(sub)


def concrete(subject: str, worker: str) -> str:
    return ".".join(worker if t == "*" else "fuzz" if t == ">" else t for t in subject.split("."))


def mesh_subjects(s: Subjects, workers: list[str]) -> list[str]:
    """Every subject ``Subjects`` names, made concrete for each of ``workers`` (and a request
    id); wildcards filled in."""
    out: set[str] = set()
    for name in dir(Subjects):
        if name.startswith("_") or name in NOT_SUBJECTS:
            continue
        attr = getattr(Subjects, name)
        if isinstance(attr, property):
            out.update(concrete(getattr(s, name), w) for w in workers)
        elif callable(attr):
            params = list(inspect.signature(attr).parameters)[1:]
            for w in [*workers, REQUEST_ID]:
                args = (role_of(w), w) if len(params) == 2 else (w,)
                out.add(concrete(getattr(s, name)(*args), w))
    return sorted(out)


def role_of(worker: str) -> str:
    return worker.rsplit("-", 1)[0]


def targets(s: Subjects, workers: list[str]) -> list[tuple[str, str, list[str]]]:
    """``(subject, publisher role, reader roles)`` for every mesh subject some role
    subscribes to or pulls (the prefill jobs), published as a role that may publish it (the
    admin last: an attacker holds a worker's credentials more likely than the operator's). A
    subject naming a worker is kept for workers of a role that reads or sends it."""
    perms = role_permissions(s)
    subjects = [*mesh_subjects(s, workers), "$SRV.PING", "$SRV.INFO", "$SRV.STATS"]
    out = []
    for subject in subjects:
        readers = [r for r, p in perms.items() if r != ADMIN and _may(p.subscribe, subject)]
        if subject == s.PREFILL_JOBS:
            readers = ["prefill"]  # pulled through the JetStream consumer
        publishers = sorted(
            (r for r, p in perms.items() if _may(p.publish, subject)), key=lambda r: r == ADMIN
        )
        named = [w for w in [*workers, REQUEST_ID] if f".{w}." in f".{subject}."]
        if named and not any(
            w == REQUEST_ID or role_of(w) in readers or role_of(w) in publishers for w in named
        ):
            continue
        if readers and publishers:
            out.append((subject, publishers[0], readers))
    return out


def _may(patterns: tuple[str, ...], subject: str) -> bool:
    return any(matches(p, subject) for p in patterns)


def example(info: msgspec.inspect.Type, rng: random.Random) -> Any:
    """A JSON value of type ``info``: small, and valid for its bounds where it has any."""
    i = msgspec.inspect
    if isinstance(info, i.StructType):
        return {f.encode_name: example(f.type, rng) for f in info.fields}
    if isinstance(info, i.UnionType):
        return example(rng.choice(info.types), rng)
    if isinstance(info, i.NoneType):
        return None
    if isinstance(info, i.BoolType):
        return rng.random() < 0.5
    if isinstance(info, i.IntType):
        low = info.ge if info.ge is not None else (info.gt + 1 if info.gt is not None else 0)
        return low + rng.randrange(3)
    if isinstance(info, i.FloatType):
        return 0.5
    if isinstance(info, i.StrType):
        return "fuzz"
    if isinstance(info, i.LiteralType):
        return rng.choice(info.values)
    if isinstance(info, (i.VarTupleType, i.ListType)):
        n = max(info.min_length or 0, rng.randrange(3))
        return [example(info.item_type, rng) for _ in range(n)]
    if isinstance(info, i.TupleType):
        return [example(t, rng) for t in info.item_types]
    if isinstance(info, i.DictType):
        return {}
    return None  # a type the protocol does not use: null, itself a wrong type


@functools.cache
def message_types() -> tuple[type[Message], ...]:
    """Every message type: what each module of shared/bus/messages/ defines, less the bases
    that messages share fields through (e.g. StoreBlocks): never sent alone."""
    found: dict[str, type[Message]] = {}
    for module in pkgutil.iter_modules(messages.__path__):
        for cls in vars(importlib.import_module(f"{messages.__name__}.{module.name}")).values():
            if isinstance(cls, type) and issubclass(cls, Message) and cls is not Message:
                found[cls.__qualname__] = cls
    bases = {base for cls in found.values() for base in cls.__mro__[1:]}
    return tuple(cls for cls in found.values() if cls not in bases)


@functools.cache
def type_info(cls: type[Message]) -> Any:
    """``msgspec.inspect.type_info`` of ``cls``, read once (it evaluates every annotation: the
    fuzz asks again for every subject)."""
    return msgspec.inspect.type_info(cls)


def bodies(rng: random.Random, max_payload: int) -> Iterator[tuple[str, bytes]]:
    """``(kind, body)``: one of every message type (the subject's own among them, valid), each
    also cut short, an empty body, junk, and one as large as the server carries."""
    for cls in message_types():
        data = msgspec.json.encode(example(type_info(cls), rng))
        yield f"type:{cls.__name__}", data
        yield f"truncated:{cls.__name__}", data[: max(1, len(data) // 2)]
    yield "empty", b""
    yield "junk", bytes(rng.randrange(256) for _ in range(64))
    yield "deep", b"[" * 10_000
    yield "oversized", b"[" + b"1," * ((max_payload - 4096) // 2) + b"1]"
