"""The routing seam: a policy picks one target (a worker's rank: target.py) per request and tracks what it routed.

The frontend calls `select` before sending, `on_first_token` when the first token comes back and
`on_finish` when the stream ends for any reason (done, failed, client gone), so a policy that counts
load never leaks it. KV-aware policies also ingest the workers' KV events.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from dynamo_cli.kv.events import KvDump, KvEventBatch
from dynamo_cli.kv.images import ImageRun
from dynamo_cli.routing.indexer import Gap
from dynamo_cli.routing.target import Target
from dynamo_cli.wire import LoadMetrics


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may look at."""

    request_id: str
    token_ids: Sequence[int]
    pinned_worker: int | None = None
    """A worker the caller asked for (header `x-worker-instance-id`): one of its ranks is chosen."""
    lora: str = ""
    """The LoRA adapter it runs with ("": the base model): its blocks hash with `lora_seed(lora)`."""
    lora_load_s: Mapping[int, float] | None = None
    """With `lora`: seconds each candidate worker would spend loading it first (0 where loaded; lora/routing.py)."""
    images: Sequence[ImageRun] = ()
    """The prompt's images: their placeholders route as their content (kv/images.py)."""


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """The chosen target and, when asked for, why."""

    target: Target
    overlap_blocks: int = 0
    explain: Callable[[], dict[str, Any]] | None = None
    """Builds the explanation from the decision's own snapshot; called only by whoever reads `explanation`
    (most requests do not ask for `x-dyn-explain-route`, and building it costs more than the cost itself)."""

    @property
    def worker_id(self) -> int:
        """The chosen target's worker."""
        return self.target.worker

    @property
    def explanation(self) -> dict[str, Any]:
        """Why this worker (empty for a policy that does not explain); built anew on each read."""
        return self.explain() if self.explain is not None else {}


@dataclass(frozen=True, slots=True)
class InFlightLoad:
    """What a policy counts on one target now (with replica sync, every frontend's and router's)."""

    num_requests: int
    active_blocks: int
    """Unique KV blocks of the requests in flight."""
    active_prefill_tokens: int


@dataclass(frozen=True, slots=True)
class PolicySnapshot:
    """What a policy counts, for `/health`, `/metrics` and `best_worker_id`; empty for one that counts nothing."""

    counters: dict[str, int] = field(default_factory=dict)
    """Its monotonic counters (decisions, hit blocks, ...), by name."""
    in_flight: dict[Target, InFlightLoad] = field(default_factory=dict)
    """Target -> what it counts there, for the targets asked about."""
    precise: frozenset[int] | None = None
    """Workers it routes from their KV events (the others approximately); None: a policy blind to caches."""


NOTHING_COUNTED = PolicySnapshot()


class RoutingPolicy(Protocol):
    """Chooses a target among the live candidates."""

    def select(self, request: RouteRequest, targets: Sequence[Target]) -> RouteDecision:
        """Pick one of `targets` (never empty; by worker, then rank) for `request`."""
        ...

    def on_first_token(self, request_id: str) -> None:
        """The request's prefill is done."""
        ...

    def on_finish(self, request_id: str) -> None:
        """The request left its worker (finished, failed or cancelled)."""
        ...

    def remove_worker(self, worker_id: int) -> None:
        """The worker left discovery: forget the state of every rank of it."""
        ...

    def apply_kv_events(self, batch: KvEventBatch) -> None:
        """Ingest a worker's KV cache changes (no-op for cache-blind policies)."""
        ...

    def apply_load(self, metrics: LoadMetrics) -> None:
        """Ingest a worker's published load (no-op for load-blind policies)."""
        ...

    def snapshot(self, targets: Iterable[Target] = ()) -> PolicySnapshot:
        """Its counters, and what it counts in flight on each of `targets`."""
        ...


class _Blind:
    """Shared no-op hooks of the cache- and load-blind policies."""

    def on_first_token(self, request_id: str) -> None:
        pass

    def on_finish(self, request_id: str) -> None:
        pass

    def remove_worker(self, worker_id: int) -> None:
        pass

    def apply_kv_events(self, batch: KvEventBatch) -> None:
        pass

    def apply_load(self, metrics: LoadMetrics) -> None:
        pass

    def snapshot(self, targets: Iterable[Target] = ()) -> PolicySnapshot:
        return NOTHING_COUNTED


def pinned_targets(request: RouteRequest, targets: Sequence[Target]) -> Sequence[Target]:
    """The ranks of the worker the caller pinned, where it is a candidate; else every target."""
    pinned = request.pinned_worker
    if pinned is None:
        return targets
    own = [t for t in targets if t.worker == pinned]
    return own or targets


class RoundRobinPolicy(_Blind):
    """Cycle through the targets in (worker, rank) order."""

    def __init__(self) -> None:
        self._next = 0

    def select(self, request: RouteRequest, targets: Sequence[Target]) -> RouteDecision:
        targets = pinned_targets(request, targets)
        chosen = targets[self._next % len(targets)]
        self._next += 1
        return RouteDecision(chosen)


class RandomPolicy(_Blind):
    """Uniform random choice."""

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def select(self, request: RouteRequest, targets: Sequence[Target]) -> RouteDecision:
        return RouteDecision(self._rng.choice(pinned_targets(request, targets)))


##### Optional abilities of a policy #####


@runtime_checkable
class RepairsKvGaps(Protocol):
    """A policy that notices gaps in a worker's KV event ids and can be repaired (kv_repair.py)."""

    def take_gaps(self) -> list[Gap]:
        """Gaps seen since the last call, at most one per worker."""
        ...

    def apply_kv_events(self, batch: KvEventBatch) -> None: ...

    def load_dump(self, dump: KvDump) -> None:
        """Replace what the policy knows of a worker's cache (every rank, every tier) by its own dump."""
        ...


@runtime_checkable
class ExpiresStale(Protocol):
    """A policy that can free requests whose end it never heard of (a lost event)."""

    def expire_stale(self) -> list[str]:
        """Free requests in flight for too long; return their ids."""
        ...
