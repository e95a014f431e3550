"""What one engine step asks of llama.cpp, and what it gets back: plain data, no ctypes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class MemoryOp:
    """A KV cache change applied before the step's decode."""

    kind: str
    """`rm` (drop positions [start, end) of seq, end -1: to the end), `cp` (share [0, end) of src with seq),
    `import` (load `state` into seq), `clear` (every sequence)."""
    seq_id: int
    src_seq_id: int = -1
    start: int = -1
    end: int = -1
    state: bytes = b""


@dataclass(slots=True)
class StepPlan:
    """One llama_decode: memory ops first, then the batch, then sampling and exports."""

    memory_ops: list[MemoryOp] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)
    """Batch rows whose logits are sampled, one per entry of `samplers`."""
    samplers: list[Any] = field(default_factory=list)
    exports: list[int] = field(default_factory=list)
    """Seq ids whose KV state is read out after the decode (prefill role)."""


@dataclass(slots=True)
class StepResult:
    """What a step produced: one sampled token per sampler, exported states, failed imports."""

    sampled: list[int]
    exported: dict[int, bytes]
    failed_imports: list[int]
