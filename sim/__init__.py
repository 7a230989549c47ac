"""``kvmesh sim``: a discrete-event simulator of a kvmesh cluster and a planner for its
prefill:decode split (pure, synchronous, no torch; ``calibrate`` and ``validate`` import the
engine and the mesh lazily).

One concept per module: ``specs`` (device and model data files), ``cost`` (the roofline),
``workload`` (requests), ``topology`` (the workers), ``worker`` (one engine's batching),
``cluster`` (the event loop), ``planner`` (the P:D search), ``report`` (tables), ``plots``
(PNG), ``calibrate`` and ``validate`` (measurements of this machine and of the real mesh).
"""
