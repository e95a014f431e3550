"""A second llama.cpp context over a loaded model, beside the runner's: one sequence of `n_ctx` tokens, the model's
weights shared (it costs only its own small KV cache). The embedder and the scorer are two kinds of it. Like the
runner it is not thread-safe: the engine calls it from its single step thread."""

from __future__ import annotations

from typing import Any

import llama_cpp

from .errors import LlamaCppError


class SideContext:
    """A context of `n_ctx` tokens in one sequence and a batch as long; `close()` frees both (not the model)."""

    KIND = "a side"
    """What the context is for, in its errors."""

    def __init__(self, model: Any, n_ctx: int, n_threads: int, embeddings: bool = False) -> None:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = n_ctx
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = n_threads
        if embeddings:
            params.embeddings = True
            params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_MEAN
        self.n_ctx = n_ctx
        self._ctx = llama_cpp.llama_init_from_model(model, params)
        if not self._ctx:
            raise LlamaCppError(f"cannot create {self.KIND} context of {n_ctx} tokens")
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(n_ctx, 0, 1)
        self._closed = False

    def close(self) -> None:
        """Free the batch and context (not the model). Idempotent."""
        if not self._closed:
            self._closed = True
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._ctx)
