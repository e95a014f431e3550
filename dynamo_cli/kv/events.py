"""KV cache events: what an engine publishes on the event plane when blocks enter or leave its cache.

Engines emit them (`Engine.kv_events`), workers publish them, routers index them. Block hashes are
computed with `dynamo_cli.kv.hashing`, so engines and routers agree on them.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Tier = Literal["device", "host", "disk"]
DEVICE: Tier = "device"
HOST: Tier = "host"
DISK: Tier = "disk"
TIERS: tuple[Tier, ...] = (DEVICE, HOST, DISK)
"""Storage tiers, fastest first: the engine's own cache, host memory, local disk (Dynamo's G1, G2, G3)."""


class StoredBlock(msgspec.Struct, frozen=True, array_like=True):
    """A full block that entered the cache."""

    block_hash: int
    """SequenceHash of the prefix ending at this block."""
    tokens_hash: int
    """BlockHash of this block's tokens alone."""


class BlockStored(msgspec.Struct, frozen=True, tag="stored"):
    """Consecutive blocks stored after `parent_hash` (None: from the first block)."""

    parent_hash: int | None
    blocks: list[StoredBlock]
    tier: Tier = DEVICE
    """Where the blocks now sit (one of TIERS); a block offloaded to host is stored there and removed from device."""


class BlockRemoved(msgspec.Struct, frozen=True, tag="removed"):
    """Blocks evicted from the cache."""

    block_hashes: list[int]
    tier: Tier = DEVICE
    """The tier the blocks left (one of TIERS)."""


class AllBlocksCleared(msgspec.Struct, frozen=True, tag="cleared"):
    """The engine's whole own cache (the device tier) was dropped; lower tiers report their own removals."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(msgspec.Struct, frozen=True, kw_only=True):
    """Events of one engine step, numbered per worker from 0 with no gaps."""

    event_id: int
    events: list[KvEvent]
    worker_id: int = 0
    timestamp: float = 0.0
    dp_rank: int = 0
    """The data-parallel rank whose cache changed (a worker's ranks share its one event numbering)."""


class KvRankDump(msgspec.Struct, frozen=True, kw_only=True):
    """One more rank's blocks in a `KvDump`."""

    dp_rank: int
    block_hashes: list[int]
    host_hashes: list[int] = []
    disk_hashes: list[int] = []


class KvDump(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's whole cached block set after event `last_event_id` (gap repair when replay is too old)."""

    worker_id: int
    last_event_id: int
    block_hashes: list[int]
    """Blocks on the device tier (the engine's own cache)."""
    host_hashes: list[int] = []
    """Blocks in host memory (a block may sit on several tiers)."""
    disk_hashes: list[int] = []
    """Blocks on local disk."""
    dp_rank: int = 0
    """The rank the lists above are of."""
    ranks: list[KvRankDump] = []
    """A worker serving several data-parallel ranks: the blocks of each rank other than `dp_rank`."""
