#!/usr/bin/env python3
"""A point-to-point Ethernet link with delay and loss, in user space: netem where the kernel
has no sch_netem.

    tap_link.py --ns NAMESPACE --outer kvvXXXX1 [--inner eth0] [--delay-ms 1] [--loss-pct 0]

It creates two TAP devices, ``--outer`` in this process's namespace and ``--inner`` in
``--ns`` (a named namespace, /run/netns/NAME), and forwards every frame between them after
``--delay-ms`` in each direction, dropping ``--loss-pct`` percent of them, as ``tc qdisc ...
netem delay D loss L`` on both ends of a veth pair would. It prints ``ready`` once both devices
exist; the caller then enslaves the outer one to a bridge and configures the inner one. The
devices belong to this process: they vanish when it exits (SIGTERM or its parent's death).

The delay is a floor, not exact: asyncio's timers wake on millisecond boundaries, so a frame
waits between D and about D + 1 ms. Order is kept (one constant delay per direction). A frame
the other device cannot take at once (its queue full) is dropped and counted, as a full qdisc
would. Pure parts (``LinkModel``) are unit-tested; scripts/netns_mesh.py runs this.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import fcntl
import os
import random
import signal
import struct
import sys
from dataclasses import dataclass

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000
MAX_FRAME = 65_536


@dataclass
class LinkModel:
    """When a frame that arrives at ``now`` leaves the link, or None when the link loses it."""

    delay_s: float
    loss_pct: float
    rng: random.Random

    def __post_init__(self) -> None:
        if self.delay_s < 0:
            raise ValueError(f"delay must be >= 0, got {self.delay_s * 1e3:g} ms")
        if not 0 <= self.loss_pct <= 100:
            raise ValueError(f"loss must be within 0..100 %, got {self.loss_pct:g}")

    def departure(self, now: float) -> float | None:
        if self.loss_pct and self.rng.random() * 100 < self.loss_pct:
            return None
        return now + self.delay_s


def open_tap(name: str) -> int:
    """A non-blocking fd of a new TAP device ``name`` (raw Ethernet frames, no packet info)."""
    if len(name.encode()) > 15:
        raise ValueError(f"interface name {name!r} is longer than 15 bytes")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def enter_netns(name: str) -> None:
    """Move this process into the named network namespace (``ip netns`` makes /run/netns/NAME)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


class Forwarder:
    """Frames from ``src`` to ``dst`` through a LinkModel, on the running loop."""

    def __init__(self, src: int, dst: int, model: LinkModel) -> None:
        self.src, self.dst, self.model = src, dst, model
        self.frames = self.lost = self.overflowed = 0
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(src, self._on_readable)

    def _on_readable(self) -> None:
        while True:
            try:
                frame = os.read(self.src, MAX_FRAME)
            except BlockingIOError:
                return
            self.frames += 1
            at = self.model.departure(self.loop.time())
            if at is None:
                self.lost += 1
            else:
                self.loop.call_at(at, self._deliver, frame)

    def _deliver(self, frame: bytes) -> None:
        try:
            os.write(self.dst, frame)
        except (BlockingIOError, OSError):  # full queue, or the device is down: the frame is lost
            self.overflowed += 1


async def run(args: argparse.Namespace) -> None:
    outer = open_tap(args.outer)
    enter_netns(args.ns)
    inner = open_tap(args.inner)
    rng = random.Random(args.seed)
    model = LinkModel(args.delay_ms / 1e3, args.loss_pct, rng)
    Forwarder(outer, inner, model)
    Forwarder(inner, outer, model)
    print("ready", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ns", required=True, help="the named network namespace of the inner end")
    p.add_argument("--outer", required=True, help="TAP device in this namespace (<= 15 bytes)")
    p.add_argument("--inner", default="eth0", help="TAP device in --ns")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each direction")
    p.add_argument("--loss-pct", type=float, default=0.0, help="frames lost, each direction")
    p.add_argument("--seed", type=int, default=0, help="of the loss draws")
    args = p.parse_args()
    try:
        asyncio.run(run(args))
    except (OSError, ValueError) as exc:
        print(f"tap_link: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
