"""Embeddings from the engine's model: a second llama.cpp context in embedding mode (mean pooling).

NOTE: the context shares the loaded model's weights, so it costs only its own small KV cache (`n_ctx`
tokens, one sequence). Each input is decoded alone from an empty cache, pooled over its tokens and
L2-normalised, as OpenAI's embeddings are. Like the runner it is not thread-safe: the engine calls it
from its single step thread.
"""

from __future__ import annotations

from typing import Any

import llama_cpp
import numpy as np

from dynamo_cli.errors import RequestError

from .errors import LlamaCppError
from .side_context import SideContext


class Embedder(SideContext):
    """An embedding-mode context over a loaded model; `embed(ids)` -> a unit vector."""

    KIND = "an embedding"

    def __init__(self, model: Any, n_ctx: int, n_threads: int) -> None:
        super().__init__(model, n_ctx, n_threads, embeddings=True)
        self.n_embd = int(llama_cpp.llama_model_n_embd(model))

    def embed(self, token_ids: list[int]) -> list[float]:
        """The unit-length mean-pooled embedding of `token_ids` (RequestError when they do not fit)."""
        if not token_ids or len(token_ids) > self.n_ctx:
            raise RequestError(
                f"an input has {len(token_ids)} tokens; embeddings take 1..{self.n_ctx} each", param="input"
            )
        llama_cpp.llama_memory_clear(self._memory, True)
        batch = self._batch
        for i, token in enumerate(token_ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = token, i, 1, 0, True
        batch.n_tokens = len(token_ids)
        code = llama_cpp.llama_decode(self._ctx, batch)
        if code != 0:
            raise LlamaCppError("could not embed an input", code)
        pooled = llama_cpp.llama_get_embeddings_seq(self._ctx, 0)
        if not pooled:
            raise LlamaCppError("the embedding context returned no pooled embedding")
        vector = np.ctypeslib.as_array(pooled, shape=(self.n_embd,)).astype(np.float64)
        norm = float(np.linalg.norm(vector))
        return (vector / norm if norm > 0 else vector).tolist()  # type: ignore[no-any-return]
