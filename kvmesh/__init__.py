"""kvmesh: disaggregated LLM serving.

The repository's top-level folders install under this one namespace (pyproject.toml maps them):
``kvmesh.shared`` (protocol, engine, transports, NATS plumbing), ``kvmesh.services`` (router,
prefill, decode, kv-registry), ``kvmesh.kernels`` (Triton and C kernels), ``kvmesh.loadgen``
(benchmarks and the load generator), and here the command line (``kvmesh.cli``,
``kvmesh.commands``)."""

__version__ = "0.1.0"


def _leave_the_checkout_root() -> None:
    """Take a source checkout's root off ``sys.path`` (``python -m`` puts the working directory
    there, and ``make test`` and ``make up`` run in the root). Its folders are installed as
    ``kvmesh.*``, so nothing is imported from the root itself, but its ``kernels/`` shadows
    Hugging Face's ``kernels`` package, which transformers >= 5.25 imports (``from kernels
    import CUDAProperties``: an ImportError in anything that loads transformers). An installed
    kvmesh (no checkout beside it) changes nothing."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if not ((root / "pyproject.toml").is_file() and (root / "kernels" / "__init__.py").is_file()):
        return
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root]


_leave_the_checkout_root()
