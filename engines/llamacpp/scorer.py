"""Text-pair scores from the engine's model: a second llama.cpp context that reads each pair's prompt and returns
how much more likely its next token is the first candidate ("yes") than the second ("no").

NOTE: this is how vLLM scores with a causal model (Qwen3-Reranker's recipe): the frontend templates each pair
as a yes/no question; the score is softmax over the two candidates' logits after the prompt, the first's. The
context shares the loaded model's weights and holds one sequence; pairs of one request share their query, so a
pair's prompt is decoded only past the part the previous pair had in common with it. Like the runner it is not
thread-safe: the engine calls it from its single step thread, a pair at a time, so that the engine's steps go on
between the pairs of a long request (its streams do not stall behind a rerank of many documents).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import llama_cpp
import numpy as np

from dynamo_cli.errors import RequestError
from dynamo_cli.wire import ScorePair

from .errors import LlamaCppError
from .side_context import SideContext


class Scorer(SideContext):
    """A logits context over a loaded model; `score(pair, candidates)` -> its score in 0..1."""

    KIND = "a scoring"

    def __init__(self, model: Any, n_ctx: int, n_threads: int) -> None:
        super().__init__(model, n_ctx, n_threads)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model)))
        self._held: list[int] = []
        """The tokens the context holds (the last pair's prompt)."""

    def score(self, pair: ScorePair, candidates: list[int]) -> float:
        """P(candidates[0]) / (P(candidates[0]) + P(candidates[1])) after the pair's prompt, decoded past what the
        context holds of it already (the previous pair's prompt: the same query's question, most often)."""
        prompt = pair.first + pair.second
        if len(prompt) > self.n_ctx:
            raise RequestError(
                f"a pair's prompt has {len(prompt)} tokens; this worker scores 1..{self.n_ctx}", param="documents"
            )
        keep = _common_prefix(self._held, prompt, len(prompt) - 1)  # one token at least is read: its logits
        self._held = []  # until the decode succeeds, the context's content is unknown
        if not llama_cpp.llama_memory_seq_rm(self._memory, 0, keep, -1):
            llama_cpp.llama_memory_clear(self._memory, True)
            keep = 0
        logits = self._decode(prompt, keep)
        self._held = prompt
        yes, no = float(logits[candidates[0]]), float(logits[candidates[1]])
        return 1.0 / (1.0 + math.exp(max(min(no - yes, 700.0), -700.0)))

    def _decode(self, prompt: list[int], start: int) -> np.ndarray:
        batch, count = self._batch, len(prompt) - start
        for i, token in enumerate(prompt[start:]):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = token, start + i, 1, 0
            batch.logits[i] = i == count - 1
        batch.n_tokens = count
        code = llama_cpp.llama_decode(self._ctx, batch)
        if code != 0:
            raise LlamaCppError("could not score a pair", code)
        row = llama_cpp.llama_get_logits_ith(self._ctx, count - 1)
        if not row:
            raise LlamaCppError("the scoring context returned no logits")
        return np.ctypeslib.as_array(row, shape=(self.n_vocab,))


class LazyScorer:
    """A Scorer made by the first pair scored: on the step thread, so once however many requests ask at once
    (most workers are never asked to score, and the context's KV cache is memory)."""

    def __init__(self, make: Callable[[], Scorer]) -> None:
        self._make = make
        self._scorer: Scorer | None = None

    def score(self, pair: ScorePair, candidates: list[int]) -> float:
        if self._scorer is None:
            self._scorer = self._make()
        return self._scorer.score(pair, candidates)

    def close(self) -> None:
        if self._scorer is not None:
            self._scorer.close()


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
