"""Paged KV blocks with prefix caching: a ref-counted active pool over an LRU pool of cached blocks.

A full block is named by the sequence hash of the prefix ending at it, so two requests sharing a
prefix share its blocks. A block still being filled (the last, partial block of a sequence) gets a
private negative key and is renamed to its sequence hash once full. A block nobody references moves
to the inactive pool: it still serves prefix hits until a new allocation evicts it, least recently
released first. Sequences release their blocks tail-first, so deeper blocks die before the shallow
prefix blocks that more requests share (Dynamo's depth-aware eviction). Every block that enters the
cache is published as `BlockStored`, every eviction as `BlockRemoved` (only with prefix caching on,
as in Dynamo and vLLM). Pure and synchronous: no clock, no I/O.

With tiers below (engines/mocker/tiers.py), `evicted` collects each evicted full block with its token
hash and parent, for the engine to offload, and `insert_cached` brings onboarded blocks back as cached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from dynamo_cli.kv.events import BlockRemoved, BlockStored, KvEvent, KvEventBatch, StoredBlock
from dynamo_cli.kv.hashing import blocks_needed

_REF = 0  # the block is active: take one more reference
_REUSE = 1  # the block is cached in the inactive pool: bring it back
_NEW = 2  # the block is not cached: take a free block (evicting if needed)


class KvManager:
    """Block accounting for one engine; tables map a request id to its blocks' keys in order."""

    __slots__ = (
        "block_size",
        "num_blocks",
        "enable_prefix_caching",
        "_active",
        "_inactive",
        "_tables",
        "_next_private",
        "_events",
        "_next_event_id",
        "_meta",
        "collect_evicted",
        "evicted",
        "_pins",
        "_pinned",
    )

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._active: dict[int, int] = {}  # key -> reference count (> 0)
        self._inactive: OrderedDict[int, None] = OrderedDict()  # LRU order: first is evicted first
        self._tables: dict[str, list[int]] = {}
        self._next_private = -1  # private keys are negative; sequence hashes are u64
        self._events: list[KvEvent] = []
        self._next_event_id = 0
        self._meta: dict[int, tuple[int, int | None]] = {}  # full block -> (tokens hash, parent hash)
        self.collect_evicted = False
        """Keep evicted full blocks in `evicted` (a tier below takes them); set before the first allocation."""
        self.evicted: list[tuple[int, int, int | None]] = []
        """(sequence hash, tokens hash, parent hash) of the blocks evicted since the owner last emptied it."""
        self._pins: OrderedDict[str, tuple[float, list[int]]] = OrderedDict()
        """Retain key -> (until, the full blocks of its last call): oldest first. Pinned blocks are cached as any
        released block, but evicted only once no unpinned cached block is left."""
        self._pinned: dict[int, str] = {}
        """Pinned block -> its pin's key."""

    ##### Queries #####

    @property
    def num_active_blocks(self) -> int:
        """Blocks referenced by at least one request (partial blocks included)."""
        return len(self._active)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks kept for prefix reuse; evicted on demand."""
        return len(self._inactive)

    @property
    def num_free_blocks(self) -> int:
        """Blocks holding nothing."""
        return self.num_blocks - len(self._active) - len(self._inactive)

    @property
    def usage(self) -> float:
        """Fraction of the cache referenced by requests (the decode timing model's input)."""
        return len(self._active) / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        """The keys of a request's blocks (a copy); negative keys are private partial blocks."""
        return list(self._tables.get(request_id, ()))

    def cached_lru_order(self) -> list[int]:
        """Sequence hashes of the inactive pool, next to be evicted first."""
        return list(self._inactive)

    def num_prefix_hits(self, seq_hashes: Sequence[int]) -> int:
        """How many leading full blocks of a sequence are already cached (active or inactive)."""
        if not self.enable_prefix_caching:
            return 0
        active, inactive = self._active, self._inactive
        for i, key in enumerate(seq_hashes):
            if key not in active and key not in inactive:
                return i
        return len(seq_hashes)

    ##### Allocation #####

    def allocate(
        self, request_id: str, num_tokens: int, seq_hashes: Sequence[int], local_hashes: Sequence[int]
    ) -> bool:
        """Grow a request's table to hold `num_tokens`; False, with nothing changed, if blocks run out.

        `seq_hashes` / `local_hashes` name every full block of the first `num_tokens` tokens (more are fine).
        """
        table = self._tables.setdefault(request_id, [])
        if table:  # a decode step inside the last block (most calls) changes nothing: answered before any planning
            block_size, has_partial = self.block_size, table[-1] < 0
            if num_tokens <= (len(table) - has_partial) * block_size + has_partial * (block_size - 1):
                return True
        if not self.enable_prefix_caching:
            return self._allocate_private(table, blocks_needed(num_tokens, self.block_size))
        num_full = num_tokens // self.block_size
        has_partial = bool(table) and table[-1] < 0
        first = len(table) - has_partial  # first index that is not yet a full block
        plan = [self._classify(seq_hashes[i]) for i in range(first, num_full)]
        frees_partial = has_partial and num_full > first and plan[0] != _NEW
        num_new = plan.count(_NEW) - (has_partial and num_full > first and plan[0] == _NEW)
        needs_partial = num_tokens % self.block_size != 0 and len(table) <= num_full
        num_new += needs_partial
        num_reused = plan.count(_REUSE)
        if num_new > self.num_free_blocks + frees_partial + len(self._inactive) - num_reused:
            return False
        self._take_cached(seq_hashes, first, plan)
        if frees_partial:
            del self._active[table.pop()]
        self.evict(num_new - self.num_free_blocks)
        self._fill_full(table, first, plan, seq_hashes, local_hashes)
        if needs_partial:
            table.append(self._new_private())
        return True

    def free(self, request_id: str) -> None:
        """Release a request's blocks tail-first; full ones stay cached for prefix reuse."""
        table = self._tables.pop(request_id, None)
        if table is not None:
            self._release(table)

    ##### Retained blocks (agent sessions) #####

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._pinned)

    def retain(self, request_id: str, key: str, until: float, budget: int) -> None:
        """Release a finished request's blocks, its full ones pinned until `until` (in the owner's clock) for `key`'s
        next request: cached, and evicted after every unpinned cached block. The key's older pin goes, and the
        oldest pins go while more than `budget` blocks would be pinned."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        self._release(table)
        self.release_pin(key)
        full = [block for block in table if block >= 0 and block not in self._pinned]
        self._pins[key] = (until, full)
        self._pinned.update(dict.fromkeys(full, key))
        while len(self._pinned) > budget and self._pins:
            self.release_pin(next(iter(self._pins)))

    def release_pin(self, key: str) -> None:
        """`key`'s pin ends (its next request holds the blocks now, or its time is up): they are cached as usual."""
        pin = self._pins.pop(key, None)
        if pin is not None:
            for block in pin[1]:
                if self._pinned.get(block) == key:
                    del self._pinned[block]

    def expire_pins(self, now: float) -> None:
        """End the pins whose time is up."""
        for key in [key for key, (until, _) in self._pins.items() if until <= now]:
            self.release_pin(key)

    def _release(self, table: list[int]) -> None:
        active, inactive = self._active, self._inactive
        for key in reversed(table):
            count = active[key] - 1
            if count:
                active[key] = count
                continue
            del active[key]
            if key >= 0:
                inactive[key] = None

    def insert_cached(self, seq_hashes: Sequence[int], local_hashes: Sequence[int], start: int, count: int) -> int:
        """Bring blocks `start .. start + count - 1` of a sequence back as cached (onboarded from a lower
        tier), evicting least recently used ones for room; returns how many went in (they stop at the first
        block already cached or when no block can be freed). `start` must be the sequence's device hits."""
        stored: list[StoredBlock] = []
        for key in seq_hashes[:start]:  # the prefix they extend is the most recently used: kept
            if key in self._inactive:
                self._inactive.move_to_end(key)
        for i in range(start, start + count):
            key = seq_hashes[i]
            if key in self._active or key in self._inactive:
                break
            if self.num_free_blocks == 0:
                if len(self._inactive) == 0:
                    break
                self.evict(1)
            self._inactive[key] = None
            self._meta[key] = (local_hashes[i], seq_hashes[i - 1] if i else None)
            stored.append(StoredBlock(block_hash=key, tokens_hash=local_hashes[i]))
        self._flush_stored(seq_hashes[start - 1] if start else None, stored)
        return len(stored)

    def add_events(self, events: Sequence[KvEvent]) -> None:
        """Append events of the tiers below to the next batch, after this cache's own."""
        self._events.extend(events)

    ##### Events #####

    def take_events(self, timestamp: float = 0.0, worker_id: int = 0) -> KvEventBatch | None:
        """The events since the last call as one batch (ids 0, 1, 2 …), or None if there were none."""
        if not self._events:
            return None
        batch = KvEventBatch(
            event_id=self._next_event_id, events=self._events, worker_id=worker_id, timestamp=timestamp
        )
        self._next_event_id += 1
        self._events = []
        return batch

    ##### Internals #####

    def _classify(self, key: int) -> int:
        if key in self._active:
            return _REF
        return _REUSE if key in self._inactive else _NEW

    def _allocate_private(self, table: list[int], num_blocks: int) -> bool:
        num_new = num_blocks - len(table)
        if num_new > self.num_free_blocks:
            return False
        for _ in range(num_new):
            table.append(self._new_private())
        return True

    def _new_private(self) -> int:
        key = self._next_private
        self._next_private -= 1
        self._active[key] = 1
        return key

    def _take_cached(self, seq_hashes: Sequence[int], first: int, plan: list[int]) -> None:
        # Hits are taken before evicting, so an eviction can never remove a block this request needs.
        active, inactive = self._active, self._inactive
        for offset, kind in enumerate(plan):
            key = seq_hashes[first + offset]
            if kind == _REF:
                active[key] += 1
            elif kind == _REUSE:
                del inactive[key]
                active[key] = 1

    def evict(self, count: int) -> None:
        if count <= 0:
            return
        if self._pinned:
            removed = self._victims(count)
            for key in removed:
                del self._inactive[key]
                self._pinned.pop(key, None)
        else:
            removed = [self._inactive.popitem(last=False)[0] for _ in range(count)]
        self._events.append(BlockRemoved(block_hashes=removed))
        if self.collect_evicted:
            meta = self._meta
            self.evicted.extend((key, *meta.pop(key)) for key in removed)

    def _victims(self, count: int) -> list[int]:
        """The `count` blocks to evict with pins held: unpinned ones least recently released first, then pinned."""
        pinned, victims = self._pinned, []
        for key in self._inactive:
            if key not in pinned:
                victims.append(key)
                if len(victims) == count:
                    return victims
        return victims + [key for key in self._inactive if key in pinned][: count - len(victims)]

    def _fill_full(
        self,
        table: list[int],
        first: int,
        plan: list[int],
        seq_hashes: Sequence[int],
        local_hashes: Sequence[int],
    ) -> None:
        # Consecutive new blocks are published as one BlockStored after their parent's hash.
        run: list[StoredBlock] = []
        run_parent: int | None = None
        for offset, kind in enumerate(plan):
            i = first + offset
            key = seq_hashes[i]
            if kind == _NEW:
                if i < len(table):  # the partial block filled up: rename it
                    del self._active[table[i]]
                    table[i] = key
                else:
                    table.append(key)
                self._active[key] = 1
                if self.collect_evicted:  # only a tier below needs a block's names at its eviction
                    self._meta[key] = (local_hashes[i], seq_hashes[i - 1] if i else None)
                if not run:
                    run_parent = seq_hashes[i - 1] if i else None
                run.append(StoredBlock(block_hash=key, tokens_hash=local_hashes[i]))
                continue
            table.append(key)
            self._flush_stored(run_parent, run)
            run = []
        self._flush_stored(run_parent, run)

    def _flush_stored(self, parent: int | None, run: list[StoredBlock]) -> None:
        if run:
            self._events.append(BlockStored(parent_hash=parent, blocks=run))
