"""How a service is configured and placed: config classes <-> flags and env, CPU placement, the
cache folder, free ports, stale per-process folders."""
