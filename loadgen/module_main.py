"""A loadgen tool run as a module of its own: ``python -m kvmesh.loadgen.<name>``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn


def run_module(
    name: str,
    doc: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> NoReturn:
    """Parse the command line with the options ``add_arguments`` adds (``doc``: the help's
    description), then exit with the code ``run`` returns."""
    parser = argparse.ArgumentParser(prog=f"python -m kvmesh.loadgen.{name}", description=doc)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
