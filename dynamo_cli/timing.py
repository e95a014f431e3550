"""Dynamo's polynomial timing model: how long a simulated forward pass takes, in milliseconds.

Fitted by Dynamo on a real GPU (`lib/mocker/src/common/perf_model.rs`). Prefill time depends only on
the new prompt tokens computed in the pass; decode time only on KV-cache usage, not on batch size.
Both are divided by the speedup ratio so that a laptop can simulate hundreds of workers. The one model
of the mocker engine (engines/mocker) and of the planner's simulator (planner/simulate.py), with the
mocker scheduler's default batch limits; it imports nothing of dyn.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_A = 4.209989e-07
PREFILL_B = 1.518344e-02
PREFILL_C = 1.650142e01
DECODE_A = -25.74
DECODE_B = 54.01
DECODE_C = 5.74
MIN_DECODE_MS = 1.0

DEFAULT_MAX_NUM_SEQS = 256
"""Most requests running at once in a simulated engine."""
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
"""Token budget of one simulated pass (prompt chunks plus one token per decoding request)."""


def prefill_ms(num_tokens: int) -> float:
    """Time to compute `num_tokens` new prompt tokens in one pass (the 16.5 ms overhead included)."""
    return max(0.0, PREFILL_A * num_tokens * num_tokens + PREFILL_B * num_tokens + PREFILL_C)


def decode_ms(kv_usage: float) -> float:
    """Time of one decode step when a fraction `kv_usage` (0..1) of the KV cache is in use."""
    return max(MIN_DECODE_MS, DECODE_A * kv_usage * kv_usage + DECODE_B * kv_usage + DECODE_C)


@dataclass(frozen=True, slots=True)
class TimingModel:
    """The polynomial model scaled by speedup ratios; one per engine."""

    speedup_ratio: float = 1.0
    """Divides prefill and decode time."""
    decode_speedup_ratio: float = 1.0
    """Further divides decode time (emulates speculative decoding)."""

    def pass_ms(self, num_prefill_tokens: int, num_decoding: int, kv_usage: float) -> float:
        """Duration of a pass computing `num_prefill_tokens` prompt tokens while `num_decoding` requests decode.

        The prefill term applies once per pass that computes any prompt token; the decode term once per
        pass in which any request decodes (a prompt's first token, emitted by the pass that computes it,
        adds none: Dynamo 1.6.1's core).
        """
        total = 0.0
        if num_prefill_tokens > 0:
            total += prefill_ms(num_prefill_tokens) / self.speedup_ratio
        if num_decoding > 0:
            total += decode_ms(kv_usage) / (self.speedup_ratio * self.decode_speedup_ratio)
        return total
