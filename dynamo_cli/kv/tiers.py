"""The tiered block store: KV blocks an engine evicted from its own cache, kept in host memory and on disk.

NOTE: the model is Dynamo's KVBM (G2 host, G3 disk below G1 device). `offload` takes the engine's evicted
full blocks into host (LRU); a block evicted from host goes to disk only at frequency >= 2 (Dynamo's
disk-offload filter: 1 on entry, doubled per onboard, minus 1 per `DECAY_BLOCKS` offloads since its last
hit), else it is dropped. `match` and `onboard` give a prefix back (a copy goes up; the block stays). Every
change is a KV event with its tier. Payloads may be None (bookkeeping only: the mocker); disk writes run on
one writer thread behind a bounded queue, so `offload` never waits on disk; a lock guards the state.

Design: docs/design/kv-tier-filter.md (the filter, eviction order, block files, what a hit is worth).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec

from dynamo_cli.errors import ConfigError
from dynamo_cli.kv import disk
from dynamo_cli.kv.events import DISK, HOST, BlockRemoved, BlockStored, KvEvent, StoredBlock, Tier
from dynamo_cli.kv.tier_stats import KvTierStats
from dynamo_cli.settings import KV_TIERS, setting

__all__ = ["KvTierConfig", "KvTierStats", "OffloadBlock", "TieredBlockStore"]

DECAY_BLOCKS = 1024
"""Offloaded blocks per frequency decay step."""
MAX_FREQUENCY = 1 << 16
MAX_PENDING_OPS = 4096
"""Disk writes and deletions queued at most; beyond it new disk offloads are dropped."""
MAX_PENDING_BYTES = 256 << 20
"""Payload bytes waiting for the disk writer at most."""
CLOSE_TIMEOUT_S = 30.0
"""How long `aclose` waits for queued disk writes to finish."""


def _bytes_of_gb(gb: float) -> int:
    return int(gb * 1e9)


def _gb_of_bytes(nbytes: int) -> float:
    return nbytes / 1e9


@dataclass(frozen=True, slots=True)
class KvTierConfig:
    """Sizes of the tiers below the engine's own cache (all zero: tiers off). GB = 10^9 bytes, as Dynamo's
    DYN_KVBM_*_CACHE_GB."""

    host_bytes: int = setting(
        0,
        "--kv-host-cache-gb",
        env="DYN_KV_HOST_CACHE_GB",
        panel=KV_TIERS,
        cli_type=float,
        parse=_bytes_of_gb,
        show=_gb_of_bytes,
    )
    """KV tier in host memory below the engine's cache, in GB = 10^9 bytes (0: off).

    The field holds the capacity in bytes."""
    disk_bytes: int = setting(
        0,
        "--kv-disk-cache-gb",
        env="DYN_KV_DISK_CACHE_GB",
        panel=KV_TIERS,
        cli_type=float,
        parse=_bytes_of_gb,
        show=_gb_of_bytes,
    )
    """KV tier on local disk below host memory, in GB = 10^9 bytes, block file headers included (0: off).

    The field holds the capacity in bytes."""
    disk_dir: str | None = setting(None, "--kv-disk-cache-dir", env="DYN_KV_DISK_CACHE_DIR", panel=KV_TIERS)
    """Directory of the disk KV tier's block files, kept across restarts (default: a temporary one, removed at
    exit)."""
    disk_filter: bool = setting(
        True,
        "--kv-disk-offload-filter/--no-kv-disk-offload-filter",
        env="DYN_KV_DISK_OFFLOAD_FILTER",
        panel=KV_TIERS,
    )
    """Move host→disk only KV blocks reused at least once (Dynamo's default).

    Reused: frequency >= 2, the disk-offload filter of the module docstring."""

    def __post_init__(self) -> None:
        if self.host_bytes < 0 or self.disk_bytes < 0:
            raise ConfigError(
                f"--kv-host-cache-gb {self.host_bytes / 1e9} / --kv-disk-cache-gb {self.disk_bytes / 1e9} must be >= 0"
            )
        if self.disk_dir is not None and self.disk_bytes <= 0:
            raise ConfigError("--kv-disk-cache-dir needs --kv-disk-cache-gb > 0")

    @property
    def enabled(self) -> bool:
        """Whether any tier below device is on."""
        return self.host_bytes > 0 or self.disk_bytes > 0


@dataclass(frozen=True, slots=True)
class OffloadBlock:
    """A full block the engine evicted, with its KV."""

    block_hash: int
    """SequenceHash of the prefix ending at this block."""
    tokens_hash: int
    """BlockHash of this block's tokens alone."""
    parent_hash: int | None
    """SequenceHash of the previous block (None: the first block)."""
    payload: bytes | None
    """The block's KV as the engine exports it (None: bookkeeping only)."""
    num_bytes: int
    """Bytes the block takes in a tier (len(payload) when there is one)."""


@dataclass(slots=True)
class _Entry:
    """One block in a tier (mutable: recency, frequency and write state change in place)."""

    block: OffloadBlock
    freq: int
    stamp: int
    """`_tick` at the last frequency change."""
    size: int = 0
    """Bytes charged to the tier (file size on disk)."""
    on_file: bool = False
    """A disk entry whose file is written (its payload then leaves memory)."""


class TieredBlockStore:
    """Host and disk tiers below one engine's cache; see the module docstring."""

    def __init__(self, config: KvTierConfig, *, fingerprint: str, block_size: int = 0) -> None:
        self.config = config
        self.block_size = block_size
        self._digest = disk.fingerprint_digest(fingerprint)
        self._lock = threading.Lock()
        self._host: OrderedDict[int, _Entry] = OrderedDict()
        self._disk: OrderedDict[int, _Entry] = OrderedDict()
        self._host_used = 0
        self._disk_used = 0
        self._foreign_bytes = 0
        """Bytes of other models' files in the disk tier's directory (counted in `_disk_used`)."""
        self._tick = 0
        self._events: list[KvEvent] = []
        self._stats = KvTierStats()
        self._dir: Path | None = None
        self._owned_dir = False
        self._ops: deque[tuple[str, _Entry]] = deque()
        self._running_op = False
        self._pending_bytes = 0
        self._wake = threading.Condition(self._lock)
        self._closing = False
        self._writer: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the disk tier: load the valid files already there (warm restart), start the writer."""
        if self.config.disk_bytes <= 0 or self._writer is not None:
            return
        if self.config.disk_dir is None:
            self._dir, self._owned_dir = Path(tempfile.mkdtemp(prefix="dyn-kv-")), True
        else:
            self._dir = Path(self.config.disk_dir)
            self._dir.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self._load_index, self._dir)
        self._writer = threading.Thread(target=self._write_loop, name="dyn-kv-disk", daemon=True)
        self._writer.start()

    async def aclose(self) -> None:
        """Finish queued disk writes (bounded wait), stop the writer; a temporary directory is removed."""
        writer = self._writer
        with self._lock:
            self._closing = True
            self._wake.notify_all()
        if writer is not None:
            await asyncio.to_thread(writer.join, CLOSE_TIMEOUT_S)
            self._writer = None
        if self._owned_dir and self._dir is not None:
            await asyncio.to_thread(shutil.rmtree, self._dir, True)

    # -- the engine's calls ----------------------------------------------------------------------------

    def offload(self, blocks: Sequence[OffloadBlock], *, seconds: float = 0.0) -> None:
        """The device evicted these full blocks (prefix order); keep them below. Never waits on disk.
        `seconds`: how long the engine took to take them out of its cache (for the metrics)."""
        with self._lock:
            self._tick += len(blocks)
            self._count(offload_seconds_d2h=seconds)
            if self.config.host_bytes > 0:
                self._offload_host(blocks)
            elif self.config.disk_bytes > 0:
                fresh = [b for b in blocks if b.block_hash not in self._disk]
                self._count(offload_blocks_d2h=len(fresh), offload_bytes_d2h=sum(b.num_bytes for b in fresh))
                self._to_disk([_Entry(b, 1, self._tick) for b in fresh])

    def touch(self, hashes: Sequence[int]) -> bool:
        """If host holds every block of `hashes` (a prefix the device evicts again), make them recent as
        `offload` would and return True: the engine need not copy them out. Else change nothing."""
        with self._lock:
            if not all(h in self._host for h in hashes):
                return False
            for h in reversed(hashes):
                self._host.move_to_end(h)
            return True

    def _locate(self, hashes: Sequence[int]) -> list[Tier]:
        tiers: list[Tier] = []
        for h in hashes:
            if h in self._host:
                tiers.append(HOST)
            elif h in self._disk:
                tiers.append(DISK)
            else:
                break
        return tiers

    def match(self, hashes: Sequence[int]) -> list[Tier]:
        """The tier of each leading block of `hashes` found in host or disk, up to the first miss."""
        with self._lock:
            tiers = self._locate(hashes)
            host = tiers.count(HOST)
            self._count(
                lookup_blocks=len(hashes),
                host_hit_blocks=host,
                disk_hit_blocks=len(tiers) - host,
                matched_tokens=len(tiers) * self.block_size,
            )
            return tiers

    async def onboard(self, hashes: Sequence[int], *, seconds: float | None = None) -> list[bytes | None]:
        """The payloads of the leading blocks of `hashes` (a matched prefix), each hit doubling its
        frequency; shorter than `hashes` where a block vanished or its file failed its check (the file
        is then deleted and counted). `seconds`: the transfer's time for the metrics when the caller
        knows it (a simulated engine); else the time the reads took here."""
        with self._lock:
            found: list[tuple[_Entry, bool]] = []
            for h in hashes:
                entry = self._host.get(h) or self._disk.get(h)
                if entry is None:
                    break
                self._bump(entry)
                found.append((entry, h in self._host))
            for entry, in_host in reversed(found):
                (self._host if in_host else self._disk).move_to_end(entry.block.block_hash)
        start = time.perf_counter()
        reads_disk = any(e.block.payload is None and e.on_file for e, _ in found)
        payloads = await asyncio.to_thread(self._read_all, found) if reads_disk else self._read_all(found)
        host = sum(1 for _, in_host in found[: len(payloads)] if in_host)
        took = time.perf_counter() - start if seconds is None else seconds
        with self._lock:
            self._count(
                onboard_blocks_h2d=host,
                onboard_bytes_h2d=sum(e.block.num_bytes for e, h in found[: len(payloads)] if h),
                onboard_blocks_d2d=len(payloads) - host,
                onboard_bytes_d2d=sum(e.block.num_bytes for e, h in found[: len(payloads)] if not h),
                onboard_seconds_h2d=took if len(found) == host else 0.0,
                onboard_seconds_d2d=took if len(found) > host else 0.0,
            )
        return payloads

    def drain_events(self) -> list[KvEvent]:
        """The KV events (tier host or disk) since the last call, in order."""
        with self._lock:
            events, self._events = self._events, []
            return events

    @property
    def stats(self) -> KvTierStats:
        """A snapshot of the counters and holdings."""
        with self._lock:
            return msgspec.structs.replace(
                self._stats,
                host_blocks=len(self._host),
                host_used_bytes=self._host_used,
                disk_blocks=len(self._disk),
                disk_used_bytes=self._disk_used,
            )

    # -- host tier -------------------------------------------------------------------------------------

    def _offload_host(self, blocks: Sequence[OffloadBlock]) -> None:
        fresh: list[OffloadBlock] = []
        room = self.config.host_bytes
        for b in reversed(blocks):  # refreshed deepest first: the parents end most recent
            if b.block_hash in self._host:
                self._host.move_to_end(b.block_hash)
        for b in blocks:
            if b.block_hash in self._host:
                continue
            if b.num_bytes <= room:
                fresh.append(b)
                room -= b.num_bytes
        self._count(offload_blocks_d2h=len(fresh), offload_bytes_d2h=sum(b.num_bytes for b in fresh))
        need = sum(b.num_bytes for b in fresh)
        evicted: list[_Entry] = []
        while self._host_used + need > self.config.host_bytes:
            _, entry = self._host.popitem(last=False)
            self._host_used -= entry.block.num_bytes
            evicted.append(entry)
        if evicted:
            self._events.append(BlockRemoved(block_hashes=[e.block.block_hash for e in evicted], tier=HOST))
            self._demote(evicted)
        entries = []
        for b in fresh:
            on_disk = self._disk.get(b.block_hash)
            entries.append(_Entry(b, on_disk.freq if on_disk else 1, on_disk.stamp if on_disk else self._tick))
        for entry in reversed(entries):
            self._host[entry.block.block_hash] = entry
        self._host_used += need
        self._announce(entries, HOST)

    def _demote(self, evicted: list[_Entry]) -> None:
        if self.config.disk_bytes <= 0:
            return
        keep = [e for e in evicted if not self.config.disk_filter or self._frequency(e) >= 2]
        self._count(filtered_blocks=len(evicted) - len(keep))
        self._to_disk([e for e in keep if e.block.block_hash not in self._disk])

    # -- disk tier -------------------------------------------------------------------------------------

    def _to_disk(self, entries: list[_Entry]) -> None:
        """Put `entries` on disk: parents first, as many as fit, the oldest disk blocks making room."""
        order = {b.block_hash: i for i, b in enumerate(b for run in _chains([e.block for e in entries]) for b in run)}
        chosen: list[tuple[_Entry, int, bool]] = []
        room, pending = self.config.disk_bytes - self._foreign_bytes, self._pending_bytes
        for entry in sorted(entries, key=lambda e: order[e.block.block_hash]):
            real = entry.block.payload is not None and self._writer is not None
            size = disk.file_size(entry.block.num_bytes) if real else entry.block.num_bytes
            fits_queue = not real or (len(self._ops) < MAX_PENDING_OPS and pending + size <= MAX_PENDING_BYTES)
            if size > room or not fits_queue:
                self._count(dropped_blocks=1)
                continue
            chosen.append((entry, size, real))
            room -= size
            pending += entry.block.num_bytes if real else 0
        need = sum(size for _, size, _ in chosen)
        removed: list[int] = []
        while self._disk_used + need > self.config.disk_bytes and self._disk:
            _, old = self._disk.popitem(last=False)
            self._disk_used -= old.size
            removed.append(old.block.block_hash)
            if old.on_file or (old.block.payload is not None and self._writer is not None):
                self._ops.append(("delete", old))
        if removed:
            self._events.append(BlockRemoved(block_hashes=removed, tier=DISK))
        stored = [self._disk_entry(entry, size, real) for entry, size, real in reversed(chosen)]
        self._announce(stored[::-1], DISK)
        self._wake.notify_all()

    def _disk_entry(self, entry: _Entry, size: int, real: bool) -> _Entry:
        block = entry.block if real else replace(entry.block, payload=None)  # no writer: bookkeeping only
        disk_entry = _Entry(block, entry.freq, entry.stamp, size)
        self._disk[block.block_hash] = disk_entry
        self._disk_used += size
        if real:
            self._ops.append(("write", disk_entry))
            self._pending_bytes += block.num_bytes
        return disk_entry

    def _write_loop(self) -> None:
        """The writer thread: run queued writes and deletions in order until closed and drained."""
        assert self._dir is not None
        while True:
            with self._lock:
                while not self._ops and not self._closing:
                    self._wake.wait()
                if not self._ops:
                    return
                op, entry = self._ops.popleft()
                payload = entry.block.payload
                self._running_op = True
            try:
                if op == "delete":
                    disk.block_path(self._dir, entry.block.block_hash).unlink(missing_ok=True)
                elif payload is not None:
                    self._write_one(self._dir, entry, payload)
            finally:
                with self._lock:
                    self._running_op = False

    @property
    def is_disk_idle(self) -> bool:
        """No disk write or deletion queued or running."""
        with self._lock:
            return not self._ops and not self._running_op

    def _write_one(self, directory: Path, entry: _Entry, payload: bytes) -> None:
        b = entry.block
        start = time.perf_counter()
        try:
            written = disk.write_block(
                directory,
                disk.BlockHeader(b.block_hash, b.parent_hash, b.tokens_hash, len(payload)),
                payload,
                self._digest,
            )
        except OSError:
            written = -1
        with self._lock:
            self._pending_bytes -= b.num_bytes
            if written < 0:
                self._count(dropped_blocks=1)
                if self._disk.get(b.block_hash) is entry:
                    del self._disk[b.block_hash]
                    self._disk_used -= entry.size
                    self._events.append(BlockRemoved(block_hashes=[b.block_hash], tier=DISK))
                return
            entry.on_file = True
            entry.block = replace(b, payload=None)
            self._count(
                offload_blocks_h2d=1, offload_bytes_h2d=written, offload_seconds_h2d=time.perf_counter() - start
            )

    def _read_all(self, found: list[tuple[_Entry, bool]]) -> list[bytes | None]:
        """Payloads in order, stopping at the first disk block whose file is gone or fails its check."""
        out: list[bytes | None] = []
        for entry, _ in found:
            b = entry.block
            if b.payload is not None or not entry.on_file:
                out.append(b.payload)
                continue
            assert self._dir is not None
            header = disk.BlockHeader(b.block_hash, b.parent_hash, b.tokens_hash, b.num_bytes)
            try:
                out.append(disk.read_block(disk.block_path(self._dir, b.block_hash), self._digest, header))
            except (OSError, disk.BlockFileError) as exc:
                self._forget_file(entry, exc)
                break
        return out

    def _forget_file(self, entry: _Entry, exc: Exception) -> None:
        with self._lock:
            if isinstance(exc, disk.BlockFileError):
                self._count(corrupt_files=1)
            if self._disk.get(entry.block.block_hash) is entry:
                del self._disk[entry.block.block_hash]
                self._disk_used -= entry.size
                self._events.append(BlockRemoved(block_hashes=[entry.block.block_hash], tier=DISK))
                self._ops.append(("delete", entry))
                self._wake.notify_all()

    def _load_index(self, directory: Path) -> None:
        """Warm restart: index the valid block files (oldest first), keeping within the size."""
        found = disk.scan(directory, self._digest)
        entries = [
            _Entry(
                OffloadBlock(h.block_hash, h.tokens_hash, h.parent_hash, None, h.payload_len), 1, 0, h.file_size, True
            )
            for h in found.valid
        ]
        while entries and found.foreign_bytes + sum(e.size for e in entries) > self.config.disk_bytes:
            disk.block_path(directory, entries.pop(0).block.block_hash).unlink(missing_ok=True)
        with self._lock:
            self._count(foreign_files=found.foreign, corrupt_files=found.corrupt)
            self._disk_used = self._foreign_bytes = found.foreign_bytes
            for entry in entries:
                self._disk[entry.block.block_hash] = entry
                self._disk_used += entry.size
            self._announce(entries, DISK)

    # -- helpers ---------------------------------------------------------------------------------------

    def _frequency(self, entry: _Entry) -> int:
        return max(1, entry.freq - (self._tick - entry.stamp) // DECAY_BLOCKS)

    def _bump(self, entry: _Entry) -> None:
        entry.freq, entry.stamp = min(MAX_FREQUENCY, self._frequency(entry) * 2), self._tick
        for tier in (self._host, self._disk):
            other = tier.get(entry.block.block_hash)
            if other is not None:
                other.freq, other.stamp = entry.freq, entry.stamp

    def _count(self, **deltas: float) -> None:
        self._stats = msgspec.structs.replace(
            self._stats, **{k: getattr(self._stats, k) + v for k, v in deltas.items()}
        )

    def _announce(self, entries: list[_Entry], tier: Tier) -> None:
        """BlockStored events for `entries`, parents before children, one event per chain run."""
        for chain in _chains([e.block for e in entries]):
            blocks = [StoredBlock(b.block_hash, b.tokens_hash) for b in chain]
            self._events.append(BlockStored(parent_hash=chain[0].parent_hash, blocks=blocks, tier=tier))


def _chains(blocks: list[OffloadBlock]) -> list[list[OffloadBlock]]:
    """`blocks` ordered parents first (where the parent is among them), cut into runs of parent→child."""
    by_hash = {b.block_hash: b for b in blocks}
    children: dict[int | None, list[OffloadBlock]] = {}
    for b in blocks:
        parent = b.parent_hash if b.parent_hash in by_hash else None
        children.setdefault(parent, []).append(b)
    roots = [b for b in blocks if b.parent_hash not in by_hash]
    runs: list[list[OffloadBlock]] = []
    stack = list(reversed(roots))
    while stack:
        run = [stack.pop()]
        while True:
            kids = children.get(run[-1].block_hash, [])
            if not kids:
                break
            stack.extend(reversed(kids[1:]))
            run.append(kids[0])
        runs.append(run)
    return runs
