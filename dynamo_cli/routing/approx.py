"""Approximate mode: without KV events, the router's own decisions stand in for the workers' caches.

NOTE: a routed request is assumed to leave its prompt blocks cached on the chosen worker for `ttl_s`
seconds (120 s, as Dynamo's `--no-kv-events`); routing the same blocks there again refreshes them. The
guess cannot see evictions, so the entry count is capped: past `max_blocks` (worker, block) entries the
earliest-expiring ones are pruned until `prune_fraction` of the cap remains. Expiry uses a heap with
lazy deletion: a refreshed entry leaves its old heap item behind, skipped when popped.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dynamo_cli.routing.indexer import KvIndexer
from dynamo_cli.routing.target import Target


@dataclass(frozen=True, slots=True)
class ApproxConfig:
    """The lifetime and size of the approximate cache."""

    ttl_s: float = 120.0
    """Seconds a routed block is presumed cached on its worker."""
    max_blocks: int = 1 << 20
    """(worker, block) entries kept at most before pruning."""
    prune_fraction: float = 0.8
    """Pruning removes the earliest-expiring entries down to this fraction of `max_blocks`."""


class ApproxIndexer:
    """A KvIndexer fed by routing decisions, whose entries expire and are pruned to a size cap."""

    def __init__(self, config: ApproxConfig | None = None) -> None:
        self.config = config or ApproxConfig()
        self._index = KvIndexer()
        self._expiry: dict[tuple[Target, int], float] = {}
        self._heap: list[tuple[float, Target, int]] = []
        self.num_expired = 0
        self.num_pruned = 0

    def __len__(self) -> int:
        """Live (target, block) entries."""
        return len(self._expiry)

    def record(self, target: Target, hashes: Sequence[int], now: float) -> None:
        """The router sent a request with these prompt blocks to `target` at `now`."""
        self.expire(now)
        expires = now + self.config.ttl_s
        for h in hashes:
            self._expiry[(target, h)] = expires
            heapq.heappush(self._heap, (expires, target, h))
        self._index.store_blocks(target, hashes)
        if len(self._expiry) > self.config.max_blocks:
            self._prune()
        if len(self._heap) > 2 * len(self._expiry) + 1024:
            self._compact()

    def find_matches(self, hashes: Sequence[int], now: float) -> dict[Target, int]:
        """Target -> contiguous prefix blocks of `hashes` presumed cached at `now`."""
        self.expire(now)
        return self._index.find_matches(hashes)

    def num_blocks(self, target: Target) -> int:
        """Blocks presumed cached on `target` (as of the last expiry)."""
        return self._index.num_blocks(target)

    def block_counts(self, targets: Sequence[Target]) -> list[int]:
        """`num_blocks` of each of `targets`."""
        return self._index.block_counts(targets)

    def expire(self, now: float) -> int:
        """Drop entries whose time is up at `now` (an entry expiring exactly at `now` is gone)."""
        removed = self._pop_while(lambda expires: expires <= now)
        self.num_expired += removed
        return removed

    def remove_worker(self, worker_id: int) -> None:
        """Forget a worker that left (every rank); its heap items become stale."""
        self._index.remove_worker(worker_id)
        for key in [key for key in self._expiry if key[0].worker == worker_id]:
            del self._expiry[key]

    def _prune(self) -> None:
        keep = int(self.config.max_blocks * self.config.prune_fraction)
        self.num_pruned += self._pop_while(lambda _: len(self._expiry) > keep)

    def _pop_while(self, keep_popping: Callable[[float], bool]) -> int:
        gone: dict[Target, list[int]] = {}
        heap = self._heap
        while heap and keep_popping(heap[0][0]):
            expires, worker, h = heapq.heappop(heap)
            if self._expiry.get((worker, h)) != expires:
                continue  # refreshed or removed since this item was pushed
            del self._expiry[(worker, h)]
            gone.setdefault(worker, []).append(h)
        for worker, hashes in gone.items():
            self._index.remove_blocks(worker, hashes)
        return sum(len(hashes) for hashes in gone.values())

    def _compact(self) -> None:
        self._heap = [(expires, worker, h) for (worker, h), expires in self._expiry.items()]
        heapq.heapify(self._heap)
