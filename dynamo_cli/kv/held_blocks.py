"""The blocks a worker's engine holds, per data-parallel rank and tier, as its KV events tell them: what the worker
answers on `kv_dump` to a router that lost events (docs/reference/wire.md)."""

from __future__ import annotations

from collections.abc import Iterable

from dynamo_cli.kv.events import (
    DEVICE,
    TIERS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvDump,
    KvEventBatch,
    KvRankDump,
    Tier,
)


class HeldBlocks:
    """Rank -> tier -> block hashes; a rank-blind engine's are all rank 0's."""

    __slots__ = ("_ranks",)

    def __init__(self, ranks: Iterable[int] = (0,)) -> None:
        """`ranks`: those the engine serves (the card's `ranks`); a batch of another rank adds that rank."""
        self._ranks: dict[int, dict[Tier, set[int]]] = {rank: _empty() for rank in ranks}

    def apply(self, batch: KvEventBatch) -> None:
        """Take in one batch's changes to its rank's blocks."""
        blocks = self._ranks.get(batch.dp_rank)
        if blocks is None:
            blocks = self._ranks[batch.dp_rank] = _empty()
        for event in batch.events:
            if type(event) is BlockStored:
                blocks[event.tier].update(block.block_hash for block in event.blocks)
            elif type(event) is BlockRemoved:
                blocks[event.tier].difference_update(event.block_hashes)
            elif type(event) is AllBlocksCleared:  # the device tier; lower tiers send their own removals
                blocks[DEVICE].clear()

    def dump(self, worker_id: int, last_event_id: int) -> KvDump:
        """Every rank's blocks, sorted: the first rank's in the dump's lists, the others' in `ranks`."""
        (first, blocks), *others = sorted(self._ranks.items()) or [(0, _empty())]
        device, host, disk = (sorted(blocks[tier]) for tier in TIERS)
        return KvDump(
            worker_id=worker_id,
            last_event_id=last_event_id,
            block_hashes=device,
            host_hashes=host,
            disk_hashes=disk,
            dp_rank=first,
            ranks=[_rank_dump(rank, held) for rank, held in others],
        )


def _empty() -> dict[Tier, set[int]]:
    return {tier: set() for tier in TIERS}


def _rank_dump(rank: int, blocks: dict[Tier, set[int]]) -> KvRankDump:
    device, host, disk = (sorted(blocks[tier]) for tier in TIERS)
    return KvRankDump(dp_rank=rank, block_hashes=device, host_hashes=host, disk_hashes=disk)
