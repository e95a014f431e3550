"""What one engine step asks of llama.cpp, and what it gets back: plain data, no ctypes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .kv_state import CheckedState


@dataclass(slots=True)
class MemoryOp:
    """A KV cache change applied before the step's decode."""

    kind: str
    """`rm` (drop positions [start, end) of seq, end -1: to the end), `cp` (share [0, end) of src with seq),
    `import` (load `state` into seq), `clear` (every sequence), `export` (read seq's state out into
    `StepResult.evicted[key]`, before the `rm` that evicts it: KV tiers)."""
    seq_id: int
    src_seq_id: int = -1
    start: int = -1
    end: int = -1
    state: CheckedState | None = None
    """For `import`: a sequence state already checked against this engine's layout."""
    key: int = -1
    """For `export`: the key of the scheduler's pending offload it feeds."""


@dataclass(slots=True)
class StepPlan:
    """One engine step: memory ops first, then the batch (one llama_decode per adapter among its sequences),
    then sampling and exports."""

    memory_ops: list[MemoryOp] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)
    """Batch rows whose logits are sampled, one per entry of `samplers`."""
    samplers: list[Any] = field(default_factory=list)
    logprobs: list[int | None] = field(default_factory=list)
    """Per entry of `samplers`: None, or the alternatives to report with the sampled token's logprob."""
    exports: list[int] = field(default_factory=list)
    """Seq ids whose KV state is read out after the decode (prefill role)."""
    loras: dict[int, str] = field(default_factory=dict)
    """Seq id -> the LoRA adapter its tokens run with (absent: the base model); one llama_decode per adapter."""


@dataclass(slots=True)
class StepResult:
    """What a step produced: a sampled token per sampled sequence, exported states, and the sequences
    that failed (their state import, or their part of the decode)."""

    sampled: dict[int, int] = field(default_factory=dict)
    """Seq id → the token sampled for it."""
    logprobs: dict[int, Any] = field(default_factory=dict)
    """Seq id → the sampled token's TokenLogprob, for sequences whose request asked."""
    exported: dict[int, bytes] = field(default_factory=dict)
    failed_imports: list[int] = field(default_factory=list)
    rejected: dict[int, str] = field(default_factory=dict)
    """Seq id → why llama.cpp refused its tokens; the step went on without it."""
    evicted: dict[int, bytes] = field(default_factory=dict)
    """Export key → the state of an evicted cached prefix (`export` ops)."""
    evict_seconds: float = 0.0
    """Time the `export` ops took."""
