"""KV memory and what names it: pools and their 8-bit formats, block hashes and headers, write
leases and immediates, the transport descriptor and the registered regions it advertises, the
kv-store client."""
