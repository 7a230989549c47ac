"""Every message kvmesh sends over NATS, each defined once as a frozen msgspec Struct, one module
per conversation (placement, prefill_jobs, token_streams, drafts, cache_events, kv_store,
workers, admin) and one codec (codec.py). Messages are small: token ids, block ids and
addresses, never KV bytes. Import a message from its module; nothing is re-exported here."""
