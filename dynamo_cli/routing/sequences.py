"""In-flight load as the router sees it: per worker, prefill tokens not yet computed and active KV blocks.

NOTE: the router predicts load from its own decisions instead of waiting for workers to report it, so
two requests routed in the same millisecond already see each other. A request adds its uncached prompt
tokens to its worker's prefill load when routed and removes them at its first token; its prompt blocks
(sequence hashes) stay active until it finishes, fails or its client disconnects. Blocks are refcounted
per worker, so requests sharing a prefix on one worker count its blocks once. Every removal is
idempotent: the frontend may report the end of a stream more than once (finish, then disconnect).
Per-worker totals (prefill tokens, unique active blocks, requests) are kept up to date by each add and
free, so a decision reads them in O(1) per candidate instead of recounting the requests in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dynamo_cli.routing.indexer import WorkerSlots, match_prefix

STALE_REQUEST_S = 300.0
"""A request in flight longer than this is presumed leaked and may be expired (Dynamo's default)."""


@dataclass(slots=True)
class _Active:
    worker_id: int
    hashes: tuple[int, ...]
    prefill_tokens: int
    """Outstanding prefill tokens; 0 once the first token came back."""
    started: float
    computing: bool = False
    """Its prompt's last block was stored on its worker (KV event): its prefill pass is running."""


class ActiveSequences:
    """Every request the router has routed and not yet seen finish, with per-worker load totals."""

    def __init__(self) -> None:
        self._requests: dict[str, _Active] = {}
        self._refs: dict[int, dict[int, int]] = {}
        """worker -> sequence hash -> number of in-flight requests using that block."""
        self._prefill: dict[int, int] = {}
        self._count: dict[int, int] = {}
        """worker -> requests in flight there (kept with every add and free, never recounted)."""
        self._masks: dict[int, int] = {}
        """sequence hash -> bits of the workers where it is active (for active-overlap queries)."""
        self._slots = WorkerSlots()
        self._pending: dict[int, set[str]] = {}
        """Last prompt block hash -> requests awaiting their first token (to notice their pass start)."""
        self._computing: dict[int, tuple[int, float]] = {}
        """worker -> (requests whose prefill pass is running there, when the latest such pass was seen start)."""

    ##### Queries #####

    def active_blocks(self, worker_id: int) -> int:
        """Unique KV blocks of the requests in flight on `worker_id`."""
        refs = self._refs.get(worker_id)
        return len(refs) if refs is not None else 0

    def active_prefill_tokens(self, worker_id: int) -> int:
        """Prompt tokens routed to `worker_id` whose first token has not come back."""
        return self._prefill.get(worker_id, 0)

    def totals(self, workers: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        """Per worker of `workers`: prefill tokens in flight, unique active blocks, requests in flight."""
        prefill, refs, count, empty = self._prefill.get, self._refs.get, self._count.get, dict[int, int]()
        return (
            [prefill(w, 0) for w in workers],
            [len(refs(w, empty)) for w in workers],
            [count(w, 0) for w in workers],
        )

    def pass_elapsed(self, workers: Sequence[int], now: float) -> list[float]:
        """Per worker: seconds since a prefill pass the router saw start there (inf: none running)."""
        computing = self._computing
        return [now - computing[w][1] if w in computing else float("inf") for w in workers]

    def active_overlaps(self, hashes: Sequence[int]) -> dict[int, int]:
        """Worker -> contiguous prefix blocks of `hashes` already active there (0s omitted)."""
        return match_prefix(self._masks, hashes, self._slots.worker_at, self._refs)

    def num_requests(self, worker_id: int | None = None) -> int:
        """Requests in flight, on one worker or in all."""
        if worker_id is None:
            return len(self._requests)
        return self._count.get(worker_id, 0)

    def started(self, request_id: str) -> float | None:
        """When a request in flight was routed (the `now` it was added with)."""
        active = self._requests.get(request_id)
        return active.started if active is not None else None

    def worker_of(self, request_id: str) -> int | None:
        """The worker a request in flight was routed to."""
        active = self._requests.get(request_id)
        return active.worker_id if active is not None else None

    def describe(self, request_id: str) -> tuple[int, tuple[int, ...], int] | None:
        """A request in flight as (worker, unique prompt block hashes, outstanding prefill tokens)."""
        active = self._requests.get(request_id)
        return None if active is None else (active.worker_id, active.hashes, active.prefill_tokens)

    ##### Lifecycle #####

    def add_request(
        self,
        request_id: str,
        worker_id: int,
        hashes: Sequence[int],
        prefill_tokens: int,
        now: float = 0.0,
    ) -> None:
        """Count a routed request: its prompt blocks and `prefill_tokens` uncached prompt tokens.

        Adding an id that is still in flight first frees the earlier one (a retry on another worker).
        """
        self.free(request_id)
        unique = tuple(dict.fromkeys(hashes))
        self._requests[request_id] = _Active(worker_id, unique, max(0, prefill_tokens), now)
        if prefill_tokens > 0 and unique:
            self._pending.setdefault(unique[-1], set()).add(request_id)
        self._prefill[worker_id] = self._prefill.get(worker_id, 0) + max(0, prefill_tokens)
        self._count[worker_id] = self._count.get(worker_id, 0) + 1
        refs = self._refs.setdefault(worker_id, {})
        bit = self._slots.bit(worker_id)
        masks = self._masks
        for h in unique:
            count = refs.get(h, 0)
            refs[h] = count + 1
            if not count:
                mask = masks.get(h)
                masks[h] = bit if mask is None else mask | bit

    def mark_prefill_completed(self, request_id: str) -> bool:
        """The first token came back: drop the request's prefill load. False if nothing was left."""
        active = self._requests.get(request_id)
        if active is None or not active.prefill_tokens:
            return False
        self._prefill[active.worker_id] -= active.prefill_tokens
        active.prefill_tokens = 0
        self._settle(request_id, active)
        return True

    def mark_stored(self, worker_id: int, block_hashes: Sequence[int], now: float) -> None:
        """`worker_id` stored these blocks (a KV event, sent when a pass starts): requests awaiting their
        first token there whose last prompt block is among them are being computed now."""
        pending = self._pending
        for h in block_hashes:
            for request_id in pending.get(h, ()):
                active = self._requests[request_id]
                if active.worker_id == worker_id and not active.computing:
                    active.computing = True
                    count = self._computing.get(worker_id, (0, now))[0]
                    self._computing[worker_id] = (count + 1, now)

    def free(self, request_id: str) -> bool:
        """The request left its worker (finished, failed, disconnected). False if it was not in flight."""
        active = self._requests.pop(request_id, None)
        if active is None:
            return False
        worker = active.worker_id
        if active.prefill_tokens:
            self._prefill[worker] -= active.prefill_tokens
            self._settle(request_id, active)
        self._count[worker] -= 1
        refs = self._refs[worker]
        keep = ~self._slots.bit(worker)
        for h in active.hashes:
            count = refs[h] - 1
            if count:
                refs[h] = count
                continue
            del refs[h]
            mask = self._masks[h] & keep
            if mask:
                self._masks[h] = mask
            else:
                del self._masks[h]
        return True

    def _settle(self, request_id: str, active: _Active) -> None:
        """The request no longer awaits its first token: it leaves the pending and computing sets."""
        if active.hashes:
            waiting = self._pending.get(active.hashes[-1])
            if waiting is not None:
                waiting.discard(request_id)
                if not waiting:
                    del self._pending[active.hashes[-1]]
        if active.computing:
            active.computing = False
            count, since = self._computing[active.worker_id]
            if count > 1:
                self._computing[active.worker_id] = (count - 1, since)
            else:
                del self._computing[active.worker_id]

    def remove_worker(self, worker_id: int) -> list[str]:
        """Free every request on a worker that left; returns their ids."""
        gone = [rid for rid, active in self._requests.items() if active.worker_id == worker_id]
        for request_id in gone:
            self.free(request_id)
        self._refs.pop(worker_id, None)
        self._prefill.pop(worker_id, None)
        self._count.pop(worker_id, None)
        self._computing.pop(worker_id, None)
        self._slots.release(worker_id)
        return gone

    def expire(self, now: float, max_age: float = STALE_REQUEST_S) -> list[str]:
        """Free requests routed more than `max_age` seconds before `now` (leaked streams)."""
        stale = [rid for rid, active in self._requests.items() if now - active.started > max_age]
        for request_id in stale:
            self.free(request_id)
        return stale
