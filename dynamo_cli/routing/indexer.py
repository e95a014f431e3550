"""The KV indexer: which target (a worker's rank) caches which blocks, queried for a request's prefix overlap.

NOTE: a flat map `sequence_hash -> bitmask of workers`, not a radix tree. A sequence hash already names
the whole prefix it ends (hashing.py chains them), so the tree's structure is redundant: the router
walks the request's hashes from block 0 and ANDs the masks until none is left. Each worker owns one
bit; a block stored or removed is one dict update and a query one dict lookup and one `int` AND per
block, so the hot paths stay a few bytecodes per block. Each worker's `set` of hashes gives its
cached-block count and lets a removal, a clear or a dump touch only that worker's blocks.

Tiers (kv/events.py): a worker may hold a block on device, in host memory, on disk, or on several. The
mask and the worker's set hold the union of its tiers, so the prefix walk is the same for every tier;
a worker that ever held a lower-tier block gets a `LowerTiers` record (its host and disk sets and the
blocks of the union that are *not* on device), and only for those workers the matched prefix is split
by tier afterwards (the fastest tier counts). A device-only worker has no record, so its stores,
removals and queries run the same bytecodes as before tiers existed. `AllBlocksCleared` clears the device
tier (the engine's own cache: vLLM's prefix-cache reset, llamacpp's reset after a failed step); blocks on
lower tiers leave with their own removal events.

Blocks are kept per target (routing/target.py: a rank-blind worker is one, rank 0); each event batch names its
rank. Event ids are per worker (its ranks share one numbering), from 0, without gaps. A batch that arrives
ahead of the next expected id is held back and reported as a `Gap`; the caller fetches the missing batches
from the worker (its ring holds the last 1,024) and feeds them in, or loads a dump of the worker's whole
block set.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, islice, takewhile
from operator import attrgetter

from dynamo_cli.kv.events import DEVICE, HOST, AllBlocksCleared, BlockRemoved, BlockStored, KvDump, KvEventBatch, Tier
from dynamo_cli.routing.target import Target

logger = logging.getLogger(__name__)

_BLOCK_HASH = attrgetter("block_hash")
_BIT_VALUE = bytes(1 if byte == ord("1") else 0 for byte in range(256))
"""A `bytes.translate` table: ASCII "1" -> 1, anything else -> 0."""

MAX_HELD_BATCHES = 1024
"""Out-of-order batches kept per worker while a gap is open (the size of a worker's event ring)."""


@dataclass(frozen=True, slots=True)
class Gap:
    """Event ids of one worker the indexer has not seen; ask the worker for them or for a dump."""

    worker_id: int
    first_missing: int
    """The next event id the indexer expects."""
    last_missing: int
    """The last id the caller should fetch (inclusive); batches after it are held back."""


@dataclass(frozen=True, slots=True)
class TierHits:
    """How a worker's matched prefix splits over its tiers (the fastest tier counts a block held on several)."""

    device: int
    host: int
    disk: int


@dataclass(slots=True)
class LowerTiers:
    """One worker's blocks below the device tier (absent for a worker that never offloaded)."""

    host: set[int]
    disk: set[int]
    off_device: set[int]
    """Blocks the worker holds on host or disk and not on device."""

    def hits(self, prefix: Sequence[int]) -> TierHits:
        """Split a matched prefix (every block held on some tier) by the fastest tier holding each."""
        off = self.off_device.intersection(prefix)  # a prefix's sequence hashes are distinct
        if not off:
            return TierHits(len(prefix), 0, 0)
        host = len(self.host.intersection(off))
        return TierHits(len(prefix) - len(off), host, len(off) - host)


class TargetSlots:
    """Gives each target one bit of a mask; the bits of removed targets are reused."""

    def __init__(self) -> None:
        self._bit_of: dict[Target, int] = {}
        self.target_at: list[Target] = []
        """Bit index -> target (stale for released bits, which no mask carries)."""
        self._free: list[int] = []

    def bit(self, target: Target) -> int:
        """The mask bit of `target`, allocated on first use."""
        bit = self._bit_of.get(target)
        if bit is None:
            if self._free:
                index = self._free.pop()
                self.target_at[index] = target
            else:
                index = len(self.target_at)
                self.target_at.append(target)
            bit = self._bit_of[target] = 1 << index
        return bit

    def release(self, target: Target) -> None:
        """Free the target's bit; the caller has already cleared it from every mask."""
        bit = self._bit_of.pop(target, None)
        if bit is not None:
            self._free.append(bit.bit_length() - 1)

    def __contains__(self, target: object) -> bool:
        return target in self._bit_of

    def targets(self) -> list[Target]:
        """Every target that holds a bit."""
        return list(self._bit_of)

    def of_worker(self, worker_id: int) -> list[Target]:
        """The targets (ranks) of one worker that hold a bit."""
        return [t for t in self._bit_of if t.worker == worker_id]


def match_prefix(
    masks: dict[int, int],
    hashes: Sequence[int],
    target_at: list[Target],
    holdings: Mapping[Target, Container[int]],
) -> dict[Target, int]:
    """For each target, how many blocks of `hashes` it holds contiguously from block 0 (0s omitted).

    `masks` maps a hash to the bits of the targets holding it, `holdings` each target to its hashes.
    The walk stops as soon as no target is left, so a miss on block 0 costs one lookup; once a single
    target is left, its own (smaller, cache-friendlier) set is scanned in C instead.
    """
    scores: dict[Target, int] = {}
    get = masks.get
    alive = -1  # every bit: the first AND keeps exactly the holders of block 0
    depth = 0
    for h in hashes:
        still = alive & get(h, 0)
        if still != alive:
            if depth:
                _assign(scores, alive & ~still, depth, target_at)
            if not still:
                return scores
            if not still & (still - 1):
                target = target_at[still.bit_length() - 1]
                rest = takewhile(holdings[target].__contains__, islice(hashes, depth + 1, None))
                scores[target] = depth + 1 + len(list(rest))
                return scores
        alive = still
        depth += 1
    if depth:
        _assign(scores, alive, depth, target_at)
    return scores


def _assign(scores: dict[Target, int], bits: int, depth: int, target_at: list[Target]) -> None:
    if not bits & (bits - 1):
        scores[target_at[bits.bit_length() - 1]] = depth
        return
    # Many targets leave at once where a shared prefix ends: pick their bits in C, not bit by bit.
    lowest_first = bin(bits).encode()[:1:-1].translate(_BIT_VALUE)  # one 0/1 byte per bit index
    scores.update(dict.fromkeys(compress(target_at, lowest_first), depth))


class KvIndexer:
    """Every target's cached blocks, fed by KV events, answering prefix-overlap queries."""

    def __init__(self, max_held_batches: int = MAX_HELD_BATCHES) -> None:
        self._masks: dict[int, int] = {}
        self._blocks: dict[Target, set[int]] = {}  # target -> every block it holds, on any tier
        self._lower: dict[Target, LowerTiers] = {}
        self._slots = TargetSlots()
        self._next_event: dict[int, int] = {}
        """Worker -> the event id expected next (its ranks share one numbering)."""
        self._held: dict[int, dict[int, KvEventBatch]] = {}
        self._max_held = max_held_batches
        self.num_batches_applied = 0
        self.num_stale_batches = 0
        """Batches ignored because their id was already applied (duplicates, replays)."""
        self.num_dropped_batches = 0
        """Out-of-order batches dropped because the hold-back buffer was full (a dump repairs)."""

    ##### Queries #####

    def find_matches(self, hashes: Sequence[int]) -> dict[Target, int]:
        """Target -> contiguous prefix blocks of `hashes` (sequence hashes) it caches; 0s omitted."""
        return match_prefix(self._masks, hashes, self._slots.target_at, self._blocks)

    def tier_hits(self, hashes: Sequence[int], matches: Mapping[Target, int]) -> dict[Target, TierHits]:
        """For the targets of `matches` (`find_matches(hashes)`) whose matched prefix has blocks below the
        device tier: its split by tier. A target left out holds its whole prefix on device."""
        lower = self._lower
        if not lower:
            return {}
        split: dict[Target, TierHits] = {}
        prefixes: dict[int, Sequence[int]] = {}  # targets leave the walk at a few depths: slice once each
        for target, depth in matches.items():
            if (tiers := lower.get(target)) is not None:
                prefix = prefixes.get(depth) or prefixes.setdefault(depth, hashes[:depth])
                if not tiers.off_device.isdisjoint(prefix):
                    split[target] = tiers.hits(prefix)
        return split

    def num_blocks(self, target: Target) -> int:
        """How many blocks `target` caches on device (the tie-breaker: fewer wins)."""
        return self.block_counts([target])[0]

    def block_counts(self, targets: Sequence[Target]) -> list[int]:
        """Device-tier blocks of each of `targets`, in one pass."""
        blocks, empty = self._blocks.get, frozenset[int]()
        counts = [len(blocks(t, empty)) for t in targets]
        if self._lower:
            lower = self._lower.get
            counts = [n - len(x.off_device) if (x := lower(t)) else n for n, t in zip(counts, targets, strict=True)]
        return counts

    def targets(self) -> list[Target]:
        """Every target the indexer has heard of."""
        return self._slots.targets()

    def workers(self) -> list[int]:
        """Every worker the indexer has heard of, in the order first heard."""
        return list(dict.fromkeys(t.worker for t in self._slots.targets()))

    def blocks_of(self, target: Target, tier: Tier | None = None) -> frozenset[int]:
        """A snapshot of the sequence hashes `target` caches on `tier` (None: on any tier)."""
        union, lower = self._blocks.get(target, set()), self._lower.get(target)
        if tier is None or tier == DEVICE:
            return frozenset(union if tier is None or lower is None else union - lower.off_device)
        return frozenset(() if lower is None else lower.host if tier == HOST else lower.disk)

    def next_event_id(self, worker_id: int) -> int:
        """The event id expected next from `worker_id` (0 for a worker never heard of)."""
        return self._next_event.get(worker_id, 0)

    def gaps(self) -> list[Gap]:
        """The gaps still open: for each worker with held-back batches, what it must resend."""
        return [
            Gap(worker, self._next_event.get(worker, 0), max(held) - 1) for worker, held in self._held.items() if held
        ]

    ##### Events #####

    def apply_batch(self, batch: KvEventBatch) -> Gap | None:
        """Apply `batch` in event-id order; a batch ahead of the expected id is held and a Gap returned.

        The same gap may be returned for several held batches; the caller should de-duplicate.
        """
        worker = batch.worker_id
        expected = self._next_event.get(worker, 0)
        if batch.event_id < expected:
            self.num_stale_batches += 1
            return None
        if batch.event_id > expected:
            return self._hold(batch, expected)
        self._apply(batch)
        self._drain_held(worker)
        return None

    def load_dump(self, dump: KvDump) -> None:
        """Replace the worker's whole block set (every rank's device, host and disk blocks) by its dump, taken
        after event `dump.last_event_id`."""
        worker = dump.worker_id
        self.clear_worker(worker)
        ranks = [(dump.dp_rank, dump.block_hashes, dump.host_hashes, dump.disk_hashes)]
        ranks += [(r.dp_rank, r.block_hashes, r.host_hashes, r.disk_hashes) for r in dump.ranks]
        for rank, device, host, disk in ranks:
            target = Target(worker, rank)
            self.store_blocks(target, device)
            self.store_blocks(target, host, "host")
            self.store_blocks(target, disk, "disk")
        self._next_event[worker] = dump.last_event_id + 1
        held = self._held.get(worker)
        if held:
            for event_id in [e for e in held if e <= dump.last_event_id]:
                del held[event_id]
        self._drain_held(worker)

    def store_blocks(self, target: Target, hashes: Iterable[int], tier: Tier = DEVICE) -> None:
        """Mark `hashes` (sequence hashes) as cached on `target`'s `tier`."""
        lower = self._lower.get(target)
        if tier == DEVICE and lower is None:
            self._mark(target, hashes)
            return
        hashes = list(hashes)
        if not hashes:
            return
        if lower is None:
            lower = self._lower[target] = LowerTiers(set(), set(), set())
        if tier == DEVICE:
            self._mark(target, hashes)
            lower.off_device.difference_update(hashes)
            return
        owned = self._blocks.get(target, ())
        new = [h for h in hashes if h not in owned]
        (lower.host if tier == HOST else lower.disk).update(hashes)
        self._mark(target, new)
        lower.off_device.update(new)

    def remove_blocks(self, target: Target, hashes: Iterable[int], tier: Tier = DEVICE) -> None:
        """Mark `hashes` as gone from `target`'s `tier`; hashes it does not hold there are ignored."""
        lower = self._lower.get(target)
        if lower is None:
            if tier == DEVICE:
                self._unmark(target, hashes)
            return
        if tier == DEVICE:
            host, disk = lower.host, lower.disk
            on_device = [h for h in hashes if h not in lower.off_device]
            gone = [h for h in on_device if h not in host and h not in disk]
            lower.off_device.update(h for h in on_device if h in host or h in disk)
        else:
            held, other = (lower.host, lower.disk) if tier == HOST else (lower.disk, lower.host)
            left = [h for h in hashes if h in held]
            held.difference_update(left)
            gone = [h for h in left if h in lower.off_device and h not in other]
            lower.off_device.difference_update(gone)
        self._unmark(target, gone)
        if not (lower.host or lower.disk or lower.off_device):
            del self._lower[target]  # back to the device-only fast path

    def _mark(self, target: Target, hashes: Iterable[int]) -> None:
        bit = self._slots.bit(target)
        owned = self._blocks.get(target)
        if owned is None:
            owned = self._blocks[target] = set()
        masks = self._masks
        setdefault = masks.setdefault
        add = owned.add
        for h in hashes:
            # A block held by one target shares that target's `bit` object: one probe, no allocation.
            mask = setdefault(h, bit)
            if mask is not bit:
                masks[h] = mask | bit
            add(h)

    def _unmark(self, target: Target, hashes: Iterable[int]) -> None:
        owned = self._blocks.get(target)
        if not owned:
            return
        bit = self._slots.bit(target)
        keep = ~bit
        masks = self._masks
        for h in hashes:
            try:
                owned.remove(h)
            except KeyError:
                continue
            mask = masks.pop(h)
            if mask is not bit and (mask := mask & keep):  # still held by other targets
                masks[h] = mask

    def clear_target(self, target: Target) -> None:
        """Drop every block of `target` on every tier (its cache was cleared)."""
        self._lower.pop(target, None)
        owned = self._blocks.get(target)
        if owned:
            self._unmark(target, list(owned))

    def clear_worker(self, worker_id: int) -> None:
        """Drop every block of every rank of `worker_id`; its event numbering goes on."""
        for target in self._slots.of_worker(worker_id):
            self.clear_target(target)

    def remove_worker(self, worker_id: int) -> None:
        """Forget `worker_id` entirely: every rank's blocks, its event numbering and its held batches."""
        for target in self._slots.of_worker(worker_id):
            self.clear_target(target)
            self._blocks.pop(target, None)
            self._slots.release(target)
        self._next_event.pop(worker_id, None)
        self._held.pop(worker_id, None)

    ##### Internals #####

    def _apply(self, batch: KvEventBatch) -> None:
        target = Target(batch.worker_id, batch.dp_rank)
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.store_blocks(target, map(_BLOCK_HASH, event.blocks), event.tier)
            elif isinstance(event, BlockRemoved):
                self.remove_blocks(target, event.block_hashes, event.tier)
            elif isinstance(event, AllBlocksCleared):
                lower = self._lower.get(target)
                if lower is None:
                    self.clear_target(target)
                else:
                    self.remove_blocks(target, list(self._blocks.get(target, set()) - lower.off_device))
        self._next_event[batch.worker_id] = batch.event_id + 1
        self.num_batches_applied += 1

    def _hold(self, batch: KvEventBatch, expected: int) -> Gap:
        worker, target = batch.worker_id, Target(batch.worker_id, batch.dp_rank)
        held = self._held.setdefault(worker, {})
        if target not in self._slots:
            self._slots.bit(target)  # a target first heard of through a gap is still a target
            self._blocks.setdefault(target, set())
        if len(held) < self._max_held:
            held[batch.event_id] = batch
            last_missing = batch.event_id - 1
        else:
            self.num_dropped_batches += 1
            last_missing = batch.event_id
        logger.debug("kv event gap on worker %d: expected %d, got %d", worker, expected, batch.event_id)
        return Gap(worker, expected, last_missing)

    def _drain_held(self, worker_id: int) -> None:
        held = self._held.get(worker_id)
        while held:
            batch = held.pop(self._next_event.get(worker_id, 0), None)
            if batch is None:
                return
            self._apply(batch)
