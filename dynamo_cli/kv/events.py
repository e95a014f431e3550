"""KV cache events: what an engine publishes on the event plane when blocks enter or leave its cache.

Engines emit them (`Engine.kv_events`), workers publish them, routers index them. Block hashes are
computed with `dynamo_cli.kv.hashing`, so engines and routers agree on them.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Tier = Literal["device", "host", "disk"]
"""Storage tiers, fastest first: the engine's own cache, host memory, local disk (Dynamo's G1, G2, G3)."""
DEVICE: Tier = "device"
HOST: Tier = "host"
DISK: Tier = "disk"
TIERS = (DEVICE, HOST, DISK)


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
    """The whole cache was dropped."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(msgspec.Struct, frozen=True, kw_only=True):
    """Events of one engine step, numbered per worker from 0 with no gaps."""

    event_id: int
    events: list[KvEvent]
    worker_id: int = 0
    timestamp: float = 0.0


class KvDump(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's whole cached block set after event `last_event_id` (gap repair when replay is too old)."""

    worker_id: int
    last_event_id: int
    block_hashes: list[int]
