"""The KV indexer: stores, removals, clears, gaps and dumps, with exact prefix scores."""

from __future__ import annotations

from dynamo_cli.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvDump,
    KvEvent,
    KvEventBatch,
    StoredBlock,
)
from dynamo_cli.kv.hashing import sequence_hashes
from dynamo_cli.routing.indexer import Gap, KvIndexer
from dynamo_cli.routing.target import Target

A, B, C, D, E = 101, 102, 103, 104, 105  # stand-ins for sequence hashes of a 5-block prompt


def stored(*hashes: int, parent: int | None = None) -> BlockStored:
    return BlockStored(parent_hash=parent, blocks=[StoredBlock(h, h + 1_000) for h in hashes])


def batch(worker: int, event_id: int, *events: KvEvent) -> KvEventBatch:
    return KvEventBatch(event_id=event_id, worker_id=worker, events=list(events))


def test_scores_count_the_contiguous_prefix_each_worker_holds() -> None:
    indexer = KvIndexer()
    indexer.apply_batch(batch(1, 0, stored(A, B, C)))
    indexer.apply_batch(batch(2, 0, stored(A, B)))
    indexer.apply_batch(batch(3, 0, stored(B, C)))  # no block 0: no prefix at all

    assert indexer.find_matches([A, B, C, D]) == {Target(1): 3, Target(2): 2}
    assert indexer.find_matches([B, C]) == {Target(1): 2, Target(2): 1, Target(3): 2}
    assert indexer.find_matches([E]) == {}
    assert indexer.find_matches([]) == {}


def test_a_stored_event_with_a_parent_extends_the_prefix() -> None:
    indexer = KvIndexer()
    indexer.apply_batch(batch(1, 0, stored(A, B)))
    indexer.apply_batch(batch(1, 1, stored(C, D, parent=B)))

    assert indexer.find_matches([A, B, C, D, E]) == {Target(1): 4}
    assert indexer.num_blocks(Target(1)) == 4


def test_a_removed_middle_block_cuts_the_prefix_there() -> None:
    indexer = KvIndexer()
    indexer.apply_batch(batch(1, 0, stored(A, B, C, D)))
    indexer.apply_batch(batch(2, 0, stored(A, B, C)))
    indexer.apply_batch(batch(1, 1, BlockRemoved(block_hashes=[B, E])))  # E was never stored: ignored

    assert indexer.find_matches([A, B, C, D]) == {Target(1): 1, Target(2): 3}
    assert indexer.num_blocks(Target(1)) == 3
    assert indexer.blocks_of(Target(1)) == {A, C, D}


def test_cleared_drops_every_block_of_the_worker_only() -> None:
    indexer = KvIndexer()
    indexer.apply_batch(batch(1, 0, stored(A, B)))
    indexer.apply_batch(batch(2, 0, stored(A)))
    indexer.apply_batch(batch(1, 1, AllBlocksCleared()))

    assert indexer.find_matches([A, B]) == {Target(2): 1}
    assert indexer.num_blocks(Target(1)) == 0
    assert indexer.next_event_id(1) == 2
    indexer.apply_batch(batch(1, 2, stored(A, B)))
    assert indexer.find_matches([A, B]) == {Target(1): 2, Target(2): 1}


def test_events_of_one_batch_apply_in_order() -> None:
    indexer = KvIndexer()
    indexer.apply_batch(batch(1, 0, stored(A, B), BlockRemoved(block_hashes=[B]), stored(B, C, parent=A)))

    assert indexer.find_matches([A, B, C]) == {Target(1): 3}


def test_a_duplicate_batch_is_ignored() -> None:
    indexer = KvIndexer()
    indexer.apply_batch(batch(1, 0, stored(A, B)))
    indexer.apply_batch(batch(1, 1, BlockRemoved(block_hashes=[B])))

    assert indexer.apply_batch(batch(1, 0, stored(A, B))) is None
    assert indexer.find_matches([A, B]) == {Target(1): 1}
    assert indexer.num_stale_batches == 1


def test_a_gap_is_reported_and_the_early_batch_held_until_the_missing_one_arrives() -> None:
    indexer = KvIndexer()
    indexer.apply_batch(batch(1, 0, stored(A)))

    gap = indexer.apply_batch(batch(1, 2, stored(C, parent=B)))
    assert gap == Gap(worker_id=1, first_missing=1, last_missing=1)
    assert indexer.find_matches([A, B, C]) == {Target(1): 1}
    assert indexer.gaps() == [Gap(1, 1, 1)]

    assert indexer.apply_batch(batch(1, 1, stored(B, parent=A))) is None
    assert indexer.find_matches([A, B, C]) == {Target(1): 3}
    assert indexer.next_event_id(1) == 3
    assert indexer.gaps() == []


def test_a_worker_first_heard_of_mid_stream_reports_a_gap_from_event_zero() -> None:
    indexer = KvIndexer()

    assert indexer.apply_batch(batch(7, 40, stored(A))) == Gap(7, 0, 39)
    assert 7 in indexer.workers()
    assert Target(7) in indexer.targets()
    assert indexer.num_blocks(Target(7)) == 0


def test_a_dump_replaces_the_block_set_and_resumes_after_its_event_id() -> None:
    indexer = KvIndexer()
    indexer.apply_batch(batch(1, 0, stored(A, B, C)))
    indexer.apply_batch(batch(1, 3, stored(D, parent=C)))  # held: 1 and 2 are missing
    indexer.apply_batch(batch(1, 5, stored(E, parent=D)))  # held: 4 is missing

    # The worker's dump after event 4: events 1-4 evicted C and stored D.
    indexer.load_dump(KvDump(worker_id=1, block_hashes=[A, B, D], last_event_id=4))

    assert indexer.blocks_of(Target(1)) == {A, B, D, E}  # held 5 applied on top, held 3 dropped
    assert indexer.find_matches([A, B, C]) == {Target(1): 2}
    assert indexer.next_event_id(1) == 6
    assert indexer.gaps() == []


def test_a_full_hold_back_buffer_drops_the_batch_and_widens_the_gap() -> None:
    indexer = KvIndexer(max_held_batches=2)
    indexer.apply_batch(batch(1, 0, stored(A)))
    indexer.apply_batch(batch(1, 2, stored(B)))
    indexer.apply_batch(batch(1, 3, stored(C)))

    assert indexer.apply_batch(batch(1, 4, stored(D))) == Gap(1, 1, 4)
    assert indexer.num_dropped_batches == 1


def test_removing_a_worker_drops_all_its_blocks_and_frees_its_slot() -> None:
    indexer = KvIndexer()
    indexer.apply_batch(batch(1, 0, stored(A, B)))
    indexer.apply_batch(batch(2, 0, stored(A, B, C)))
    indexer.remove_worker(1)

    assert indexer.find_matches([A, B, C]) == {Target(2): 3}
    assert indexer.num_blocks(Target(1)) == 0
    assert 1 not in indexer.workers()

    indexer.apply_batch(batch(3, 0, stored(A)))  # takes worker 1's old bit
    assert indexer.find_matches([A, B, C]) == {Target(2): 3, Target(3): 1}
    assert indexer.next_event_id(1) == 0  # a returning worker starts its numbering again


def test_scores_for_real_prompts_follow_their_shared_token_prefix() -> None:
    system = list(range(64))
    first = sequence_hashes(system + [1000 + i for i in range(32)], 16)
    second = sequence_hashes(system + [2000 + i for i in range(32)], 16)
    indexer = KvIndexer()
    indexer.store_blocks(Target(1), first)
    indexer.store_blocks(Target(2), second)

    assert indexer.find_matches(first) == {Target(1): 6, Target(2): 4}
    assert indexer.find_matches(sequence_hashes(system + [3000] * 16, 16)) == {Target(1): 4, Target(2): 4}


def test_many_workers_dropping_out_at_once_all_get_their_depth() -> None:
    indexer = KvIndexer()
    for worker in range(70):  # more than 64 workers: masks are plain Python ints
        indexer.store_blocks(Target(worker), [A, B] if worker % 2 else [A, B, C])

    scores = indexer.find_matches([A, B, C, D])
    assert scores == {Target(worker): 2 if worker % 2 else 3 for worker in range(70)}


def test_reused_worker_slots_report_the_right_workers_when_many_drop_at_once() -> None:
    indexer = KvIndexer()
    for worker in range(10):
        indexer.store_blocks(Target(worker), [A, B, C])
    for worker in (2, 5, 7):
        indexer.remove_worker(worker)
    indexer.store_blocks(Target(20), [A, B])  # takes a freed bit
    indexer.store_blocks(Target(21), [A])  # takes another

    assert indexer.find_matches([A, B, C, D]) == {
        Target(0): 3,
        Target(1): 3,
        Target(3): 3,
        Target(4): 3,
        Target(6): 3,
        Target(8): 3,
        Target(9): 3,
        Target(20): 2,
        Target(21): 1,
    }
