"""vLLM adapter: `engine.VllmEngine` drives vLLM's async engine; `kv_events` relays its ZMQ KV events."""
