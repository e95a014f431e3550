"""KV block hashing shared by engines and routers, so both always agree.

Only full blocks are hashed. `local[i] = xxh3_64(le_u32(tokens of block i), seed=1337)`;
`seq[0] = local[0]`, `seq[i] = xxh3_64(le_u64(seq[i-1]) ++ le_u64(local[i]), seed=1337)`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

HASH_SEED = 1337

_PAIR = struct.Struct("<QQ")


def _xxh(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data, seed=HASH_SEED)


def block_hash(tokens: Sequence[int]) -> int:
    """Token-local hash of one block."""
    return _xxh(struct.pack(f"<{len(tokens)}I", *tokens))


def chain_hash(parent: int | None, local: int) -> int:
    """Sequence hash of a block given the sequence hash of the block before it."""
    if parent is None:
        return local
    return _xxh(_PAIR.pack(parent, local))


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Token-local hashes of every full block of `tokens`."""
    n = len(tokens) // block_size
    return [block_hash(tokens[i * block_size : (i + 1) * block_size]) for i in range(n)]


def sequence_hashes(tokens: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """Chained sequence hashes of every full block of `tokens`, optionally continuing `parent`."""
    out: list[int] = []
    for local in block_hashes(tokens, block_size):
        parent = chain_hash(parent, local)
        out.append(parent)
    return out
