"""KV block hashing shared by engines and routers, so both always agree.

Only full blocks are hashed. `local[i] = xxh3_64(le_u32(tokens of block i), seed=S)`;
`seq[0] = local[0]`, `seq[i] = xxh3_64(le_u64(seq[i-1]) ++ le_u64(local[i]), seed=1337)`.
S is 1337 for the base model and `lora_seed(name)` = 1337 + xxh3_64(name) (mod 2**64) for a LoRA adapter, as
Dynamo seeds it (`protocols.rs`): the base model's hashes are unchanged and two adapters never share a block.
The chaining is written once, in `_chain`; everything else calls it.
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Sequence
from typing import NewType

import xxhash

BlockHash = NewType("BlockHash", int)
"""xxh3 of one block's tokens alone (token-local)."""
SequenceHash = NewType("SequenceHash", int)
"""xxh3 chained over every block up to this one: identifies a prefix."""

HASH_SEED = 1337

_PAIR = struct.Struct("<QQ")
_U32 = next(code for code in "IL" if array.array(code).itemsize == 4)


def _xxh(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data, seed=HASH_SEED)


def lora_seed(lora: str) -> int:
    """The seed of the token-local hashes of blocks computed under adapter `lora` ("" : the base model's, 1337)."""
    if not lora:
        return HASH_SEED
    return (HASH_SEED + xxhash.xxh3_64_intdigest(lora.encode())) & 0xFFFFFFFFFFFFFFFF


def block_hash(tokens: Sequence[int], seed: int = HASH_SEED) -> int:
    """Token-local hash of one block."""
    return xxhash.xxh3_64_intdigest(_pack_u32(tokens), seed=seed)


def chain_hash(parent: int | None, local: int) -> int:
    """Sequence hash of a block given the sequence hash of the block before it."""
    if parent is None:
        return local
    return _xxh(_PAIR.pack(parent, local))


def num_full_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks `num_tokens` fill completely (the ones that get hashed)."""
    return num_tokens // block_size


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens`, the last one possibly partial."""
    return -(-num_tokens // block_size)


def hash_blocks(
    tokens: Sequence[int],
    block_size: int,
    *,
    start: int = 0,
    parent: int | None = None,
    num_tokens: int | None = None,
    seed: int = HASH_SEED,
) -> list[tuple[int, int]]:
    """(sequence hash, token-local hash) of each full block of `tokens[:num_tokens]` from block `start` on,
    the first chained onto `parent` (the sequence hash of block `start - 1`; None from the first block);
    `seed`: the token-local hashes' (`lora_seed`)."""
    sequence, local = _chain(tokens, block_size, start, parent, num_tokens, seed)
    return list(zip(sequence, local, strict=True))


def _chain(
    tokens: Sequence[int], block_size: int, start: int, parent: int | None, num_tokens: int | None, seed: int
) -> tuple[list[int], list[int]]:
    """The sequence hashes and the token-local hashes of `hash_blocks`' blocks, as two lists."""
    total = len(tokens) if num_tokens is None else num_tokens
    end = num_full_blocks(total, block_size)
    if end <= start:
        return [], []
    # One pack for all blocks, then views: the same bytes as packing block by block, at a fifth the cost.
    # A whole prompt is packed as it is, which spares copying the list: its partial last block is packed
    # too, so an id outside u32 there raises as well.
    whole = start == 0 and len(tokens) - end * block_size < block_size
    data = memoryview(_pack_u32(tokens if whole else tokens[start * block_size : end * block_size]))
    width, xxh, pair = 4 * block_size, xxhash.xxh3_64_intdigest, _PAIR.pack
    local = [xxh(data[offset : offset + width], seed) for offset in range(0, (end - start) * width, width)]
    sequence: list[int] = []
    for block in local:
        parent = block if parent is None else xxh(pair(parent, block), HASH_SEED)
        sequence.append(parent)
    return sequence, local


def _pack_u32(tokens: Sequence[int]) -> bytes:
    """`tokens` as little-endian u32 (OverflowError for an id outside [0, 2**32))."""
    if isinstance(tokens, list):  # fromlist: a third faster than array(code, tokens) on a list
        packed = array.array(_U32)
        packed.fromlist(tokens)
    else:
        packed = array.array(_U32, tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def block_hashes(tokens: Sequence[int], block_size: int, seed: int = HASH_SEED) -> list[int]:
    """Token-local hashes of every full block of `tokens`."""
    n = num_full_blocks(len(tokens), block_size)
    return [block_hash(tokens[i * block_size : (i + 1) * block_size], seed) for i in range(n)]


def sequence_hashes(
    tokens: Sequence[int], block_size: int, parent: int | None = None, seed: int = HASH_SEED
) -> list[int]:
    """Chained sequence hashes of every full block of `tokens`, optionally continuing `parent`; `seed`: the
    token-local hashes' (`lora_seed`)."""
    return _chain(tokens, block_size, 0, parent, None, seed)[0]
