"""How a service is configured and placed: config classes <-> flags and env, the NATS options and the mesh's subjects, CPU placement, the
cache folder, free ports, stale per-process folders."""
