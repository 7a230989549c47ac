"""Topology: which workers a simulated cluster has and how each schedules its steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Mode = Literal["colocated", "disagg"]


@dataclass(frozen=True, slots=True)
class Topology:
    """``colocated``: ``num_decode`` workers that each prefill and decode (continuous batching; a
    step carries every running decode, then prompt chunks up to ``chunk_tokens`` tokens in all,
    or whole prompts when ``chunk_tokens`` is None). ``disagg``: ``num_prefill`` prefill workers
    pulling jobs from one queue and prefilling ``chunk_tokens`` per step (each chunk's KV sent
    while the next computes), and ``num_decode`` decode workers that only decode.

    Every worker is ``tp`` devices. ``shared_device``: all workers run on one device (a mesh on
    one CPU host) and divide its cores while busy (``sharing.py``): decode and colocated workers
    with ``decode_threads`` threads, prefill workers with ``prefill_threads`` at niceness
    ``prefill_nice`` (None: all the device's cores), as ``kvmesh up`` starts them.
    ``kv_capacity_tokens``: KV pool of a colocated or decode worker (None: from device memory).
    ``block_tokens``: the engine's KV block; prefill workers cut hand-off chunks on it (whole
    blocks, the last one after a first at most one block), as the engine does (None: plain
    ``chunk_tokens`` chunks). ``decode_pacing_s``: a decode or colocated worker starts a step at
    most this often (``--min-step-interval-ms``). ``no_decode_chunk_tokens``: a colocated step
    with no decode in it gives the oldest prompt up to this many tokens
    (``--max-num-batched-tokens-no-decode``; 0: ``chunk_tokens`` always)."""

    mode: Mode
    num_decode: int = 1
    num_prefill: int = 0
    chunk_tokens: int | None = 2048
    max_num_seqs: int = 256
    max_prefill_jobs: int = 1
    tp: int = 1
    decode_pacing_s: float = 0.0
    kv_capacity_tokens: int | None = None
    shared_device: bool = False
    decode_threads: int | None = None
    prefill_threads: int | None = None
    prefill_nice: int = 0
    block_tokens: int | None = 16
    no_decode_chunk_tokens: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("colocated", "disagg"):
            raise ValueError(f"mode must be colocated or disagg, got {self.mode!r}")
        if self.num_decode < 1:
            raise ValueError(
                f"a topology needs at least one decode/colocated worker, got {self.num_decode}"
            )
        if self.mode == "disagg" and self.num_prefill < 1:
            raise ValueError("a disaggregated topology needs at least one prefill worker")
        if self.mode == "colocated" and self.num_prefill:
            raise ValueError("a colocated topology has no prefill workers")
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1 (or None), got {self.chunk_tokens}")
        if self.mode == "disagg" and self.chunk_tokens is None:
            raise ValueError("a disaggregated topology prefills in chunks: give chunk_tokens")
        for name in ("max_num_seqs", "max_prefill_jobs", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.decode_pacing_s < 0:
            raise ValueError(f"decode_pacing_s must be >= 0, got {self.decode_pacing_s}")
        for name in ("decode_threads", "prefill_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or None), got {value}")
        if not 0 <= self.prefill_nice <= 19:
            raise ValueError(f"prefill_nice must be in [0, 19], got {self.prefill_nice}")
        if self.block_tokens is not None and self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1 (or None), got {self.block_tokens}")
        if (
            self.mode == "disagg"
            and self.block_tokens is not None
            and self.chunk_tokens is not None
            and self.chunk_tokens < self.block_tokens
        ):
            raise ValueError(
                f"chunk_tokens ({self.chunk_tokens}) must hold at least one block "
                f"({self.block_tokens} tokens): hand-off chunks are whole blocks"
            )
        if self.no_decode_chunk_tokens < 0:
            raise ValueError(
                f"no_decode_chunk_tokens must be >= 0, got {self.no_decode_chunk_tokens}"
            )
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < 1:
            raise ValueError(f"kv_capacity_tokens must be >= 1, got {self.kv_capacity_tokens}")

    @property
    def num_devices(self) -> int:
        return (self.num_prefill + self.num_decode) * self.tp

    @property
    def label(self) -> str:
        chunk = "no chunking" if self.chunk_tokens is None else f"chunk {self.chunk_tokens}"
        if self.mode == "colocated":
            return f"colocated x{self.num_decode} ({chunk})"
        return f"disagg {self.num_prefill}P:{self.num_decode}D ({chunk})"
