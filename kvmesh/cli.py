"""The ``kvmesh`` command. Each subcommand lives in its own module, exposing
``register(subparsers)`` which adds its parser and sets ``func(args) -> int``.
Command modules keep their top-level imports light; heavy imports happen inside ``func``."""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
from typing import NoReturn

# Each module's register(subparsers) adds one or more subcommands to the top-level parser.
COMMAND_MODULES: tuple[str, ...] = (
    "kvmesh.commands.generate",
    "kvmesh.commands.bench",
    "kvmesh.commands.serve",
    "kvmesh.commands.up",
    "kvmesh.commands.admin",
    "kvmesh.commands.model",
    "kvmesh.commands.nats_config",
    "kvmesh.commands.sim",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh", description="Disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # the reader went away (`kvmesh admin status | head`): stop quietly, as Unix tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it


def run() -> NoReturn:
    """The process entry (``kvmesh``, ``python -m kvmesh``, ``python -m kvmesh.cli``): ``main``,
    then exit without garbage-collecting what it leaves. Interpreter exit collects the whole
    heap, and with torch imported that takes seconds of CPU (3 s on a loaded 2-core box): every
    stopped service paid it, and ``kvmesh up`` stops its tiers one after the other. A frozen heap
    is skipped; atexit handlers and reference-count finalizers still run. Not with triton loaded
    (the GPU kernels): its nanobind bindings would report what a frozen heap keeps as leaks."""
    try:
        code = main()
    finally:
        if "triton" not in sys.modules:
            gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
