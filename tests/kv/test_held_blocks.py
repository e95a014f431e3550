"""A worker's memory of its engine's blocks, per data-parallel rank and tier, and the `kv_dump` it answers from it."""

from dynamo_cli.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvDump,
    KvEventBatch,
    KvRankDump,
    StoredBlock,
)
from dynamo_cli.kv.held_blocks import HeldBlocks


def stored(event_id: int, dp_rank: int, hashes: list[int], tier: str = "device") -> KvEventBatch:
    blocks = [StoredBlock(h, 0) for h in hashes]
    return KvEventBatch(
        event_id=event_id, dp_rank=dp_rank, events=[BlockStored(parent_hash=None, blocks=blocks, tier=tier)]
    )  # type: ignore[arg-type]


def test_a_rank_blind_engines_blocks_are_rank_0s_and_the_dump_has_no_other_ranks() -> None:
    held = HeldBlocks()
    held.apply(stored(0, 0, [3, 1, 2]))
    held.apply(stored(1, 0, [1], tier="host"))
    held.apply(KvEventBatch(event_id=2, events=[BlockRemoved(block_hashes=[2])]))
    assert held.dump(0x9, 2) == KvDump(
        worker_id=0x9, last_event_id=2, block_hashes=[1, 3], host_hashes=[1], disk_hashes=[], dp_rank=0, ranks=[]
    )


def test_each_rank_keeps_its_own_blocks_and_the_first_rank_leads_the_dump() -> None:
    held = HeldBlocks(range(4, 7))
    held.apply(stored(0, 5, [50, 51]))
    held.apply(stored(1, 4, [40]))
    held.apply(stored(2, 6, [60], tier="disk"))
    held.apply(stored(3, 6, [61]))
    held.apply(KvEventBatch(event_id=4, dp_rank=6, events=[AllBlocksCleared()]))  # rank 6's device tier only
    held.apply(KvEventBatch(event_id=5, dp_rank=5, events=[BlockRemoved(block_hashes=[40, 51])]))  # 40 is rank 4's
    assert held.dump(0x9, 5) == KvDump(
        worker_id=0x9,
        last_event_id=5,
        block_hashes=[40],
        dp_rank=4,
        ranks=[KvRankDump(dp_rank=5, block_hashes=[50]), KvRankDump(dp_rank=6, block_hashes=[], disk_hashes=[60])],
    )


def test_a_rank_the_card_did_not_name_is_kept_too_and_a_rank_with_nothing_is_dumped_empty() -> None:
    held = HeldBlocks([1, 2])
    held.apply(stored(0, 3, [30]))
    dump = held.dump(0x9, 0)
    assert (dump.dp_rank, dump.block_hashes) == (1, [])
    assert dump.ranks == [KvRankDump(dp_rank=2, block_hashes=[]), KvRankDump(dp_rank=3, block_hashes=[30])]
