"""Tensor-parallel ranks driven as one engine: the leader calls, the followers replay (SPMD).

Every rank holds a whole ``LLMEngine`` over its share of the model (``shard_model``): the same
scheduler, block manager and sampler, so given the same calls in the same order every rank
schedules the same batches and samples the same tokens (the logits are all-gathered). Only the
leader (group rank 0) talks to the outside; ``LeaderEngine`` is its engine: each call that changes
engine state is broadcast to the followers (``EngineCall``, one ``broadcast_object_list`` over the
TP group) before the leader makes it, and ``follow`` on each follower makes it too, until the
leader's ``close``. Reads (``kv_pool``, ``has_unfinished`` ...) are the leader's own.

A call the engine refuses (``REFUSALS``: the same on every rank, the ranks being in the same
state) raises on the leader, whose caller handles it, and is passed over on the followers.
Callbacks do not travel: a follower's ``on_call`` gives the keyword arguments it adds to a call
(its own ``on_chunk``), from the call's ``note`` (what the leader tells followers beside the call,
such as where a prefill job's KV goes). Calls on a ``LeaderEngine`` must come from one thread at a
time, in the order the engine is to see them (the services already hold one engine lock).

Each collective has a timeout (``TP_COLLECTIVE_TIMEOUT_S``), a follower's wait for the next call
too. So an idle leader sends a keepalive (``KEEPALIVE``, passed over by ``follow``) whenever no
call went out for ``keepalive_s``, and a call or keepalive that fails (a follower hung past the
timeout, or gone) marks the leader broken: ``on_broken(error)`` (the worker's ``RankProcesses``
then takes it down) and every later call raises ``TPGroupError`` at once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from kvmesh.shared.engine.block_manager import OutOfBlocksError
from kvmesh.shared.engine.tp_ranks import TP_COLLECTIVE_TIMEOUT_S, TPGroupError

# LLMEngine methods that change its state: the followers make every one of them too
FOLLOWED_METHODS = frozenset(
    {
        "add_request",
        "step",
        "abort",
        "release",
        "reserve_blocks",
        "free_reserved",
        "admit_prefilled",
    }
)
STOP = "stop"
KEEPALIVE = "keepalive"  # an idle leader's: keeps the followers' wait under the timeout
# What an engine call raises on every rank alike when it refuses its arguments (a request that
# does not fit, no blocks left): the leader's caller handles it, a follower goes on. Anything
# else (a collective that failed: RuntimeError) ends ``follow``.
REFUSALS: tuple[type[Exception], ...] = (ValueError, OutOfBlocksError)


@dataclass(frozen=True, slots=True)
class EngineCall:
    """One call of the leader's engine, as followers replay it; ``method`` STOP ends ``follow``."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    note: Any = None

    def __post_init__(self) -> None:
        assert self.method in FOLLOWED_METHODS or self.method in (STOP, KEEPALIVE), self.method


class LeaderEngine:
    """The leader's engine: an ``LLMEngine`` whose state-changing calls the followers replay."""

    def __init__(
        self,
        engine: Any,
        group: dist.ProcessGroup | None = None,
        on_broken: Callable[[BaseException], None] | None = None,
        keepalive_s: float = TP_COLLECTIVE_TIMEOUT_S / 4,
    ) -> None:
        assert dist.get_rank(group) == 0, "the leader is rank 0 of its TP group"
        self.engine = engine
        self.group = group
        self.tp_size = dist.get_world_size(group)
        self.is_closed = False
        self.broken: BaseException | None = None
        self.on_broken = on_broken
        self.keepalive_s = keepalive_s
        self._lock = threading.Lock()  # a call (broadcast, then the engine's) or a keepalive
        self._last_sent = time.monotonic()
        self._closing = threading.Event()
        self._keepalive = threading.Thread(
            target=self._keep_alive, name="tp-keepalive", daemon=True
        )
        self._keepalive.start()

    def __getattr__(self, name: str) -> Any:
        if name in FOLLOWED_METHODS:
            return lambda *args, **kwargs: self.call(name, *args, **kwargs)
        return getattr(self.engine, name)

    def call(self, method: str, *args: Any, note: Any = None, **kwargs: Any) -> Any:
        """Tell the followers, then make the call here. ``on_chunk`` stays here (followers bring
        their own); ``note`` goes to the followers only."""
        assert not self.is_closed, "the followers stopped: this leader engine is closed"
        sent = {k: v for k, v in kwargs.items() if k != "on_chunk"}
        with self._lock:
            self._check()
            try:
                self._send(EngineCall(method, args, sent, note))
                return getattr(self.engine, method)(*args, **kwargs)
            except REFUSALS:
                raise
            except RuntimeError as exc:  # a collective failed (gloo, NCCL): the group is gone
                self._break(exc)
                raise TPGroupError(f"tensor-parallel {method} failed: {exc}") from exc

    def close(self) -> bool:
        """Stop the followers (their ``follow`` returns). False when the group was broken
        already (a follower gone or hung: nothing to tell)."""
        if self.is_closed:
            return self.broken is None
        self.is_closed = True
        self._closing.set()
        with self._lock:
            if self.broken is not None:
                return False
            try:
                self._send(EngineCall(STOP))
            except RuntimeError as exc:  # gloo: a peer's connection closed
                self._break(exc)
                return False
        return True

    def _send(self, call: EngineCall) -> None:
        _broadcast(call, self.group)
        self._last_sent = time.monotonic()

    def _check(self) -> None:
        if self.broken is not None:
            raise TPGroupError(f"the tensor-parallel group is broken: {self.broken}")

    def _break(self, error: BaseException) -> None:
        if self.broken is None:
            self.broken = error
            if self.on_broken is not None:
                self.on_broken(error)

    def _keep_alive(self) -> None:
        """Send a keepalive whenever no call went out for ``keepalive_s`` (a call in flight
        holds the lock: its collectives keep the followers busy meanwhile)."""
        while not self._closing.wait(self.keepalive_s / 4):
            if time.monotonic() - self._last_sent < self.keepalive_s:
                continue
            with self._lock:
                if self._closing.is_set() or self.broken is not None:
                    return
                try:
                    self._send(EngineCall(KEEPALIVE))
                except RuntimeError as exc:
                    self._break(exc)
                    return


def follow(
    engine: Any,
    group: dist.ProcessGroup | None = None,
    on_call: Callable[[EngineCall], dict[str, Any]] | None = None,
) -> int:
    """Replay the leader's calls on ``engine`` until it closes; returns how many were made.
    ``on_call(call)``: keyword arguments this rank adds to the call (``on_chunk``)."""
    assert dist.get_rank(group) != 0, "rank 0 of the TP group leads; the others follow"
    num_calls = 0
    while True:
        call = _broadcast(None, group)
        if call.method == STOP:
            return num_calls
        if call.method == KEEPALIVE:
            continue
        extra = on_call(call) if on_call is not None else {}
        # refused here as on the leader, whose caller handles it: go on in step
        with contextlib.suppress(*REFUSALS):
            getattr(engine, call.method)(*call.args, **call.kwargs, **extra)
        num_calls += 1


def _broadcast(call: EngineCall | None, group: dist.ProcessGroup | None) -> EngineCall:
    box = [call]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]
