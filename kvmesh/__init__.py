"""kvmesh: disaggregated LLM serving.

The repository's top-level folders install under this one namespace (pyproject.toml maps them):
``kvmesh.shared`` (protocol, engine, transports, NATS plumbing), ``kvmesh.services`` (router,
prefill, decode, kv-registry), ``kvmesh.kernels`` (Triton and C kernels), ``kvmesh.loadgen``
(benchmarks and the load generator), and here the command line (``kvmesh.cli``,
``kvmesh.commands``)."""

__version__ = "0.1.0"
