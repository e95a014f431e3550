"""KV cache vocabulary shared by engines and routers: block hashing and KV events. Imports no other layer."""
