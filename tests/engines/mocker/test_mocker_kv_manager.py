"""The paged KV cache: exact block counts, prefix hits, LRU and tail-first eviction, KV events."""

from dyn_engines.mocker.kv_manager import KvManager

from dynamo_cli.kv.events import BlockRemoved, BlockStored, StoredBlock
from dynamo_cli.kv.hashing import block_hashes, sequence_hashes

BS = 4


def hashes(tokens: list[int]) -> tuple[list[int], list[int]]:
    return sequence_hashes(tokens, BS), block_hashes(tokens, BS)


def allocate(kv: KvManager, request_id: str, tokens: list[int], num_tokens: int | None = None) -> bool:
    seq, local = hashes(tokens)
    return kv.allocate(request_id, len(tokens) if num_tokens is None else num_tokens, seq, local)


def stored(tokens: list[int], first: int, last: int) -> BlockStored:
    seq, local = hashes(tokens)
    parent = seq[first - 1] if first else None
    blocks = [StoredBlock(block_hash=seq[i], tokens_hash=local[i]) for i in range(first, last)]
    return BlockStored(parent_hash=parent, blocks=blocks)


PROMPT = list(range(10))  # 2 full blocks + a partial of 2 tokens
SEQ, LOCAL = hashes(PROMPT)


def test_a_prompt_takes_its_full_blocks_plus_one_partial_block() -> None:
    kv = KvManager(num_blocks=8, block_size=BS)
    assert allocate(kv, "a", PROMPT)
    table = kv.block_table("a")
    assert table[:2] == SEQ and table[2] < 0
    assert (kv.num_active_blocks, kv.num_cached_blocks, kv.num_free_blocks) == (3, 0, 5)


def test_full_blocks_are_published_as_one_stored_event_chained_from_no_parent() -> None:
    kv = KvManager(num_blocks=8, block_size=BS)
    allocate(kv, "a", PROMPT)
    batch = kv.take_events()
    assert batch is not None
    assert batch.event_id == 0
    assert batch.events == [stored(PROMPT, 0, 2)]
    assert kv.take_events() is None


def test_a_shared_prefix_is_referenced_not_copied_and_not_published_again() -> None:
    kv = KvManager(num_blocks=8, block_size=BS)
    allocate(kv, "a", PROMPT)
    kv.take_events()
    other = PROMPT[:8] + [99, 98, 97]
    assert kv.num_prefix_hits(hashes(other)[0]) == 2
    assert allocate(kv, "b", other)
    assert kv.block_table("b")[:2] == SEQ
    assert kv.num_active_blocks == 4  # two shared full blocks + one partial each
    assert kv.take_events() is None


def test_a_partial_block_that_fills_up_is_renamed_to_its_sequence_hash() -> None:
    kv = KvManager(num_blocks=8, block_size=BS)
    tokens = list(range(8))
    allocate(kv, "a", tokens, num_tokens=6)
    kv.take_events()
    allocate(kv, "a", tokens, num_tokens=8)
    assert kv.block_table("a") == hashes(tokens)[0]
    assert kv.num_active_blocks == 2
    batch = kv.take_events()
    assert batch is not None and batch.events == [stored(tokens, 1, 2)]


def test_a_partial_block_that_fills_up_into_a_cached_block_is_released_for_it() -> None:
    kv = KvManager(num_blocks=8, block_size=BS)
    tokens = list(range(8))
    allocate(kv, "a", tokens)
    allocate(kv, "b", tokens, num_tokens=6)
    assert kv.num_active_blocks == 3  # a's two blocks, b's partial
    kv.take_events()
    allocate(kv, "b", tokens, num_tokens=8)
    assert kv.block_table("b") == hashes(tokens)[0]
    assert kv.num_active_blocks == 2
    assert kv.take_events() is None


def test_freed_blocks_stay_cached_tail_first_and_the_partial_block_is_dropped() -> None:
    kv = KvManager(num_blocks=8, block_size=BS)
    tokens = list(range(14))  # 3 full blocks + a partial
    allocate(kv, "a", tokens)
    kv.free("a")
    seq = hashes(tokens)[0]
    assert kv.cached_lru_order() == [seq[2], seq[1], seq[0]]
    assert (kv.num_active_blocks, kv.num_cached_blocks, kv.num_free_blocks) == (0, 3, 5)


def test_a_block_shared_by_two_requests_is_cached_only_when_both_release_it() -> None:
    kv = KvManager(num_blocks=8, block_size=BS)
    allocate(kv, "a", PROMPT)
    allocate(kv, "b", PROMPT[:8] + [50, 51])
    kv.free("a")
    assert kv.num_active_blocks == 3 and kv.num_cached_blocks == 0
    kv.free("b")
    assert kv.num_active_blocks == 0 and kv.cached_lru_order() == [SEQ[1], SEQ[0]]


def test_eviction_takes_the_least_recently_released_blocks_deepest_first() -> None:
    kv = KvManager(num_blocks=4, block_size=BS)
    first, second = list(range(8)), list(range(100, 108))
    allocate(kv, "a", first)
    allocate(kv, "b", second)
    kv.free("a")
    kv.free("b")
    assert kv.take_events() is not None
    third = list(range(200, 212))  # needs 3 blocks: a's two and b's deeper block go
    assert allocate(kv, "c", third)
    a_seq, b_seq = hashes(first)[0], hashes(second)[0]
    batch = kv.take_events()
    assert batch is not None and batch.event_id == 1
    assert batch.events == [BlockRemoved(block_hashes=[a_seq[1], a_seq[0], b_seq[1]]), stored(third, 0, 3)]
    assert kv.cached_lru_order() == [b_seq[0]]


def test_a_prefix_hit_in_the_cached_pool_is_taken_back_before_evicting() -> None:
    kv = KvManager(num_blocks=3, block_size=BS)
    tokens = list(range(8))
    allocate(kv, "a", tokens)
    kv.free("a")
    kv.take_events()
    longer = tokens + [7, 7, 7, 7]
    assert kv.num_prefix_hits(hashes(longer)[0]) == 2
    assert allocate(kv, "b", longer)
    assert kv.num_active_blocks == 3 and kv.num_cached_blocks == 0
    batch = kv.take_events()
    assert batch is not None and batch.events == [stored(longer, 2, 3)]


def test_an_allocation_that_does_not_fit_fails_and_changes_nothing() -> None:
    kv = KvManager(num_blocks=3, block_size=BS)
    allocate(kv, "a", list(range(8)))
    kv.take_events()
    assert not allocate(kv, "b", list(range(50, 59)))  # needs 3 blocks, 1 is free
    assert kv.block_table("b") == []
    assert (kv.num_active_blocks, kv.num_free_blocks) == (2, 1)
    assert kv.take_events() is None


def test_event_batches_are_numbered_from_zero_without_gaps() -> None:
    kv = KvManager(num_blocks=64, block_size=BS)
    ids = []
    for i in range(5):
        allocate(kv, str(i), list(range(i * 100, i * 100 + 4)))
        batch = kv.take_events()
        assert batch is not None
        ids.append(batch.event_id)
        assert kv.take_events() is None  # an empty take must not use up an id
    assert ids == [0, 1, 2, 3, 4]


def test_without_prefix_caching_nothing_is_shared_cached_or_published() -> None:
    kv = KvManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    allocate(kv, "a", PROMPT)
    allocate(kv, "b", PROMPT)
    assert kv.num_prefix_hits(SEQ) == 0
    assert kv.num_active_blocks == 6
    kv.free("a")
    kv.free("b")
    assert (kv.num_active_blocks, kv.num_cached_blocks, kv.num_free_blocks) == (0, 0, 8)
    assert kv.take_events() is None


def test_usage_is_the_fraction_of_blocks_referenced() -> None:
    kv = KvManager(num_blocks=8, block_size=BS)
    allocate(kv, "a", PROMPT)
    assert kv.usage == 3 / 8
    kv.free("a")
    assert kv.usage == 0.0


def test_a_retained_calls_blocks_are_evicted_last_until_its_session_returns_or_its_time_is_up() -> None:
    kv = KvManager(num_blocks=6, block_size=BS)
    session = list(range(100, 108))  # 2 full blocks
    assert allocate(kv, "call-1", session + [1])
    kv.retain("call-1", "agent", until=10.0, budget=3)
    assert kv.num_pinned_blocks == 2 and kv.num_active_blocks == 0  # cached, pinned
    for i in range(5):  # other traffic churns the cache: the unpinned blocks go first
        assert allocate(kv, f"other-{i}", list(range(200 + 16 * i, 216 + 16 * i)))
        kv.free(f"other-{i}")
    assert kv.num_prefix_hits(sequence_hashes(session, BS)) == 2
    assert allocate(kv, "call-2", session + [2, 3])  # the session returns: its blocks are there
    kv.release_pin("agent")
    kv.free("call-2")
    assert kv.num_pinned_blocks == 0
    assert allocate(kv, "call-3", session + [4])
    kv.retain("call-3", "agent", until=10.0, budget=3)
    assert allocate(kv, "big", list(range(300, 324)))  # 6 blocks: the pinned ones too are evicted, no failure
    assert kv.num_prefix_hits(sequence_hashes(session, BS)) == 0 and kv.num_pinned_blocks == 0
    kv.free("big")
    assert allocate(kv, "call-4", session + [5])
    kv.retain("call-4", "agent", until=10.0, budget=3)
    kv.expire_pins(now=9.9)
    assert kv.num_pinned_blocks == 2
    kv.expire_pins(now=10.0)
    assert kv.num_pinned_blocks == 0 and kv.num_cached_blocks >= 2  # cached as usual


def test_pins_beyond_the_budget_go_oldest_first() -> None:
    kv = KvManager(num_blocks=16, block_size=BS)
    for i in range(3):
        assert allocate(kv, f"c{i}", list(range(16 * i, 16 * i + 8)))
        kv.retain(f"c{i}", f"s{i}", until=100.0, budget=4)
    assert kv.num_pinned_blocks == 4  # s0's two blocks were let go for s2's
