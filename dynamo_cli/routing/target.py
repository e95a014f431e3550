"""A routing target: one data-parallel rank of one worker, each rank with a scheduler and a KV cache of its own.

A rank-blind worker is one target, its rank 0. A worker serving ranks `dp_start .. dp_start + dp_size` (its card's
`ranks`) is that many targets: the indexer, the in-flight load, the cost and the explanation count each apart, and
the chosen rank travels to the engine in `GenerateRequest.dp_rank` (Dynamo's `WorkerWithDpRank`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple


class Target(NamedTuple):
    """One rank of one worker (ordered by worker, then rank)."""

    worker: int
    """The worker's instance id."""
    rank: int = 0
    """The data-parallel rank (0 for a rank-blind worker)."""

    def label(self) -> str:
        """`3fa2` for rank 0, `3fa2/1` for rank 1: how logs, headers and `dyn ls` name it."""
        return f"{self.worker:x}" if self.rank == 0 else f"{self.worker:x}/{self.rank}"


def targets_of(workers: Iterable[int], ranks: Mapping[int, range] | None = None) -> list[Target]:
    """Every target of `workers`, by worker then rank; a worker missing from `ranks` is one rank, rank 0."""
    if not ranks:
        return [Target(w) for w in workers]
    single = range(1)
    return [Target(w, r) for w in workers for r in ranks.get(w, single)]
