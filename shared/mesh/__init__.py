"""What mesh members share on top of the planes below: write leases over the transport, the
kv-store client and prefix reads into an engine's cache."""
