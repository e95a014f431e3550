"""Multi-LoRA serving: one base model, many adapters, each a model of its own.

    adapters.py   the worker's AdapterSet: which adapters it serves (`--lora`, run-time loads), which are
                  loaded (`--max-loras`, least recently used first out), a request's adapter pinned while it runs
    routing.py    the routers' view: which workers serve an adapter and which have it loaded, and what sending
                  a request to a worker that must load it first costs

Block hashes are seeded with the adapter's name (`kv.hashing.lora_seed`), so KV caches never mix across
adapters; the engines apply the adapter (`engine.ServesLoras`).
"""
