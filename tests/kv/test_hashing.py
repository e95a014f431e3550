"""Block hashing pinned to vectors computed independently with the `xxhash` library."""

from __future__ import annotations

import random
import struct

import pytest
import xxhash

from dynamo_cli.kv.hashing import HASH_SEED, block_hash, block_hashes, chain_hash, hash_blocks, sequence_hashes

# Computed once with xxhash.xxh3_64_intdigest(..., seed=1337) directly, not through dynamo_cli.
LOCAL_1_TO_4 = 14643705804678351452  # le_u32 of [1, 2, 3, 4]
LOCAL_5_TO_8 = 16777012769546811212  # le_u32 of [5, 6, 7, 8]
LOCAL_9_TO_12 = 483935686894639516  # le_u32 of [9, 10, 11, 12]
SEQ_1_TO_8 = 4945711292740353085  # xxh3(le_u64(LOCAL_1_TO_4) ++ le_u64(LOCAL_5_TO_8))
SEQ_1_TO_12 = 12583592247330656132  # xxh3(le_u64(SEQ_1_TO_8) ++ le_u64(LOCAL_9_TO_12))


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        pytest.param([1, 2, 3, 4], LOCAL_1_TO_4, id="1-2-3-4"),
        pytest.param([0] * 16, 5523182284766269584, id="sixteen-zeros"),
        pytest.param(list(range(16)), 15310707395893867146, id="zero-to-fifteen"),
        pytest.param([2**32 - 1] * 4, 12410542959481710713, id="max-u32"),
    ],
)
def test_block_hash_matches_the_pinned_xxh3_vector(tokens: list[int], expected: int) -> None:
    assert block_hash(tokens) == expected


def test_the_seed_is_1337() -> None:
    assert HASH_SEED == 1337


def test_pinned_vectors_agree_with_xxhash_called_directly() -> None:
    def local(tokens: list[int]) -> int:
        return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens), seed=1337)

    assert local([1, 2, 3, 4]) == LOCAL_1_TO_4
    assert xxhash.xxh3_64_intdigest(struct.pack("<QQ", LOCAL_1_TO_4, LOCAL_5_TO_8), seed=1337) == SEQ_1_TO_8


def test_the_first_sequence_hash_is_the_first_local_hash() -> None:
    assert chain_hash(None, LOCAL_1_TO_4) == LOCAL_1_TO_4


def test_sequence_hashes_chain_each_block_onto_its_parent() -> None:
    assert sequence_hashes(list(range(1, 13)), 4) == [LOCAL_1_TO_4, SEQ_1_TO_8, SEQ_1_TO_12]
    assert chain_hash(SEQ_1_TO_8, LOCAL_9_TO_12) == SEQ_1_TO_12


def test_only_full_blocks_are_hashed() -> None:
    assert block_hashes(list(range(1, 15)), 4) == [LOCAL_1_TO_4, LOCAL_5_TO_8, LOCAL_9_TO_12]
    assert sequence_hashes([1, 2, 3], 4) == []


def test_sequence_hashes_continue_from_a_parent() -> None:
    assert sequence_hashes(list(range(5, 13)), 4, parent=LOCAL_1_TO_4) == [SEQ_1_TO_8, SEQ_1_TO_12]


def test_the_same_block_after_different_prefixes_gets_different_sequence_hashes() -> None:
    one = sequence_hashes([1, 2, 3, 4, 9, 10, 11, 12], 4)
    other = sequence_hashes([5, 6, 7, 8, 9, 10, 11, 12], 4)
    assert block_hashes([1, 2, 3, 4, 9, 10, 11, 12], 4)[1] == block_hashes([5, 6, 7, 8, 9, 10, 11, 12], 4)[1]
    assert one[1] != other[1]


def test_hash_blocks_from_a_start_block_and_up_to_a_length_match_block_by_block_hashing() -> None:
    tokens = list(range(1, 23))  # 5 full blocks of 4, then 2 tokens
    expected, parent = [], None
    for i in range(5):
        local = block_hash(tokens[4 * i : 4 * i + 4])
        parent = chain_hash(parent, local)
        expected.append((parent, local))

    assert list(hash_blocks(tokens, 4)) == expected
    assert list(hash_blocks(tokens, 4, start=2, parent=expected[1][0])) == expected[2:]
    assert list(hash_blocks(tokens, 4, start=1, parent=expected[0][0], num_tokens=13)) == expected[1:3]
    assert list(hash_blocks(tokens, 4, start=5, parent=expected[4][0])) == []


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_hashing_a_whole_prompt_or_a_range_of_it_matches_the_block_by_block_definition(block_size: int) -> None:
    rng = random.Random(block_size)
    for _ in range(40):
        tokens = [rng.randrange(2**32) for _ in range(rng.randrange(5 * block_size))]
        expected, parent = [], None
        for i in range(len(tokens) // block_size):
            parent = chain_hash(parent, block_hash(tokens[i * block_size : (i + 1) * block_size]))
            expected.append(parent)
        assert sequence_hashes(tokens, block_size) == expected
        assert sequence_hashes(tuple(tokens), block_size) == expected  # not a list: packed another way
        start = rng.randrange(len(expected) + 1)
        num_tokens = rng.randrange(start * block_size, len(tokens) + 1)
        ranged = [
            seq
            for seq, _ in hash_blocks(
                tokens, block_size, start=start, num_tokens=num_tokens, parent=expected[start - 1] if start else None
            )
        ]
        assert ranged == expected[start : num_tokens // block_size]


def test_a_token_outside_u32_is_refused() -> None:
    with pytest.raises(OverflowError):
        sequence_hashes([1, 2, 3, 2**32], 4)
    with pytest.raises(OverflowError):
        sequence_hashes([1, 2, 3, -1], 4)
