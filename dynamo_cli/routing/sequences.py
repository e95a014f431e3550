"""In-flight load as the router sees it: per target (a worker's rank), prefill tokens not computed, active KV blocks.

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

from dynamo_cli.routing.indexer import TargetSlots, match_prefix
from dynamo_cli.routing.target import Target

STALE_REQUEST_S = 300.0
"""A request in flight longer than this is presumed leaked and may be expired (Dynamo's default)."""


@dataclass(slots=True)
class _Active:
    target: Target
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
        self._refs: dict[Target, dict[int, int]] = {}
        """target -> sequence hash -> number of in-flight requests using that block."""
        self._prefill: dict[Target, int] = {}
        self._count: dict[Target, int] = {}
        """target -> requests in flight there (kept with every add and free, never recounted)."""
        self._masks: dict[int, int] = {}
        """sequence hash -> bits of the workers where it is active (for active-overlap queries)."""
        self._slots = TargetSlots()
        self._pending: dict[int, set[str]] = {}
        """Last prompt block hash -> requests awaiting their first token (to notice their pass start)."""
        self._computing: dict[Target, tuple[int, float]] = {}
        """target -> (requests whose prefill pass is running there, when the latest such pass was seen start)."""

    ##### Queries #####

    def active_blocks(self, target: Target) -> int:
        """Unique KV blocks of the requests in flight on `target`."""
        refs = self._refs.get(target)
        return len(refs) if refs is not None else 0

    def active_prefill_tokens(self, target: Target) -> int:
        """Prompt tokens routed to `target` whose first token has not come back."""
        return self._prefill.get(target, 0)

    def totals(self, targets: Sequence[Target]) -> tuple[list[int], list[int], list[int]]:
        """Per target of `targets`: prefill tokens in flight, unique active blocks, requests in flight."""
        prefill, refs, count, empty = self._prefill.get, self._refs.get, self._count.get, dict[int, int]()
        return (
            [prefill(w, 0) for w in targets],
            [len(refs(w, empty)) for w in targets],
            [count(w, 0) for w in targets],
        )

    def pass_elapsed(self, targets: Sequence[Target], now: float) -> list[float]:
        """Per target: seconds since a prefill pass the router saw start there (inf: none running)."""
        computing = self._computing
        return [now - computing[w][1] if w in computing else float("inf") for w in targets]

    def active_overlaps(self, hashes: Sequence[int]) -> dict[Target, int]:
        """Target -> contiguous prefix blocks of `hashes` already active there (0s omitted)."""
        return match_prefix(self._masks, hashes, self._slots.target_at, self._refs)

    def num_requests(self, target: Target | None = None) -> int:
        """Requests in flight, on one target or in all."""
        if target is None:
            return len(self._requests)
        return self._count.get(target, 0)

    def started(self, request_id: str) -> float | None:
        """When a request in flight was routed (the `now` it was added with)."""
        active = self._requests.get(request_id)
        return active.started if active is not None else None

    def target_of(self, request_id: str) -> Target | None:
        """The target a request in flight was routed to."""
        active = self._requests.get(request_id)
        return active.target if active is not None else None

    def describe(self, request_id: str) -> tuple[Target, tuple[int, ...], int] | None:
        """A request in flight as (target, unique prompt block hashes, outstanding prefill tokens)."""
        active = self._requests.get(request_id)
        return None if active is None else (active.target, active.hashes, active.prefill_tokens)

    ##### Lifecycle #####

    def add_request(
        self,
        request_id: str,
        target: Target,
        hashes: Sequence[int],
        prefill_tokens: int,
        now: float = 0.0,
    ) -> None:
        """Count a routed request: its prompt blocks and `prefill_tokens` uncached prompt tokens.

        Adding an id that is still in flight first frees the earlier one (a retry on another worker).
        """
        self.free(request_id)
        unique = tuple(dict.fromkeys(hashes))
        self._requests[request_id] = _Active(target, unique, max(0, prefill_tokens), now)
        if prefill_tokens > 0 and unique:
            self._pending.setdefault(unique[-1], set()).add(request_id)
        self._prefill[target] = self._prefill.get(target, 0) + max(0, prefill_tokens)
        self._count[target] = self._count.get(target, 0) + 1
        refs = self._refs.setdefault(target, {})
        bit = self._slots.bit(target)
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
        self._prefill[active.target] -= active.prefill_tokens
        active.prefill_tokens = 0
        self._settle(request_id, active)
        return True

    def mark_stored(self, target: Target, block_hashes: Sequence[int], now: float) -> None:
        """`target` stored these blocks (a KV event, sent when a pass starts): requests awaiting their
        first token there whose last prompt block is among them are being computed now."""
        pending = self._pending
        for h in block_hashes:
            for request_id in pending.get(h, ()):
                active = self._requests[request_id]
                if active.target == target and not active.computing:
                    active.computing = True
                    count = self._computing.get(target, (0, now))[0]
                    self._computing[target] = (count + 1, now)

    def free(self, request_id: str) -> bool:
        """The request left its worker (finished, failed, disconnected). False if it was not in flight."""
        active = self._requests.pop(request_id, None)
        if active is None:
            return False
        target = active.target
        if active.prefill_tokens:
            self._prefill[target] -= active.prefill_tokens
            self._settle(request_id, active)
        self._count[target] -= 1
        refs = self._refs[target]
        keep = ~self._slots.bit(target)
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
            count, since = self._computing[active.target]
            if count > 1:
                self._computing[active.target] = (count - 1, since)
            else:
                del self._computing[active.target]

    def remove_worker(self, worker_id: int) -> list[str]:
        """Free every request on every rank of a worker that left; returns their ids."""
        gone = [rid for rid, active in self._requests.items() if active.target.worker == worker_id]
        for request_id in gone:
            self.free(request_id)
        for target in self._slots.of_worker(worker_id):
            self._refs.pop(target, None)
            self._prefill.pop(target, None)
            self._count.pop(target, None)
            self._computing.pop(target, None)
            self._slots.release(target)
        return gone

    def expire(self, now: float, max_age: float = STALE_REQUEST_S) -> list[str]:
        """Free requests routed more than `max_age` seconds before `now` (leaked streams)."""
        stale = [rid for rid, active in self._requests.items() if now - active.started > max_age]
        for request_id in stale:
            self.free(request_id)
        return stale
