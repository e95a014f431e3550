"""The disk tier's block file: one file per KV block, with a header that proves what it holds.

A file is `<block hash, 16 hex digits>.kvb`, little-endian:

    8s magic b"DYNKVB\\x00\\x01", u16 version, u16 flags (bit 0: has a parent),
    16s model fingerprint digest (blake2b-128 of the fingerprint string),
    u64 block hash, u64 parent hash (0 without a parent), u64 tokens hash, u64 payload length,
    32s checksum (blake2b-256 of the header fields above and the payload), payload bytes

`read_header` checks everything but the checksum (a directory scan at start, cheap); `read_block`
checks everything, the checksum included, before a payload may go to the engine (and from there into
C code). A file fails as `CORRUPT` (bad magic, version, length or checksum, truncated) or `FOREIGN`
(another model's fingerprint). Writes go to a temporary name and are renamed into place, so a crash
leaves either the whole file or a `.tmp` that the next scan deletes.
"""

from __future__ import annotations

import enum
import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"DYNKVB\x00\x01"
VERSION = 1
SUFFIX = ".kvb"
_HAS_PARENT = 1
_FIELDS = struct.Struct("<8sHH16sQQQQ")
_HEADER_SIZE = _FIELDS.size + 32
_U64 = (1 << 64) - 1


class FileFault(enum.Enum):
    """Why a block file was skipped."""

    CORRUPT = "corrupt"
    """Truncated, a bad magic, version or length, or a checksum that does not match."""
    FOREIGN = "foreign"
    """Written for another model (its fingerprint differs)."""


class BlockFileError(ValueError):
    """A block file that must not be used; `fault` says which kind."""

    def __init__(self, fault: FileFault, message: str) -> None:
        super().__init__(message)
        self.fault = fault


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """What a valid block file's header says."""

    block_hash: int
    """SequenceHash of the prefix ending at this block."""
    parent_hash: int | None
    """SequenceHash of the block before it (None: the first block)."""
    tokens_hash: int
    """BlockHash of this block's tokens alone."""
    payload_len: int
    """Bytes of KV payload after the header."""

    @property
    def file_size(self) -> int:
        """Bytes the whole file takes."""
        return _HEADER_SIZE + self.payload_len


def fingerprint_digest(fingerprint: str) -> bytes:
    """The 16 bytes a block file carries to name its model."""
    return hashlib.blake2b(fingerprint.encode(), digest_size=16).digest()


def file_size(payload_len: int) -> int:
    """Bytes a block file with a `payload_len`-byte payload takes."""
    return _HEADER_SIZE + payload_len


def block_path(directory: Path, block_hash: int) -> Path:
    """Where block `block_hash` lives in `directory`."""
    return directory / f"{block_hash & _U64:016x}{SUFFIX}"


def encode(header: BlockHeader, payload: bytes, digest: bytes) -> bytes:
    """The whole file for `payload` under `header`, for the model whose fingerprint digest is `digest`."""
    flags = _HAS_PARENT if header.parent_hash is not None else 0
    fields = _FIELDS.pack(
        MAGIC,
        VERSION,
        flags,
        digest,
        header.block_hash & _U64,
        (header.parent_hash or 0) & _U64,
        header.tokens_hash & _U64,
        len(payload),
    )
    return fields + _checksum(fields, payload) + payload


def write_block(directory: Path, header: BlockHeader, payload: bytes, digest: bytes) -> int:
    """Write the block's file atomically (temporary name, then rename); the bytes written."""
    path = block_path(directory, header.block_hash)
    tmp = path.with_suffix(".tmp")
    data = encode(header, payload, digest)
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return len(data)


def parse_header(data: bytes, digest: bytes, size: int) -> BlockHeader:
    """The header at the start of `data` for a file of `size` bytes; BlockFileError if it is not ours."""
    if len(data) < _HEADER_SIZE:
        raise BlockFileError(FileFault.CORRUPT, f"{len(data)} bytes, shorter than the {_HEADER_SIZE}-byte header")
    magic, version, flags, file_digest, block, parent, tokens, length = _FIELDS.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION:
        raise BlockFileError(FileFault.CORRUPT, f"magic {magic!r} version {version}: not a dyn KV block file")
    if file_digest != digest:
        raise BlockFileError(FileFault.FOREIGN, "written for another model (fingerprint differs)")
    if _HEADER_SIZE + length != size:
        raise BlockFileError(FileFault.CORRUPT, f"{size} bytes, but the header says {_HEADER_SIZE + length}")
    return BlockHeader(block, parent if flags & _HAS_PARENT else None, tokens, length)


def read_header(path: Path, digest: bytes) -> BlockHeader:
    """The checked header of the file at `path` (no checksum check: that needs the payload)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(_HEADER_SIZE)
    header = parse_header(head, digest, size)
    if block_path(path.parent, header.block_hash).name != path.name:
        raise BlockFileError(FileFault.CORRUPT, f"{path.name} holds block {header.block_hash:016x}")
    return header


def read_block(path: Path, digest: bytes, expected: BlockHeader) -> bytes:
    """The payload of the file at `path`, checked in full against `expected` and its checksum."""
    data = path.read_bytes()
    header = parse_header(data, digest, len(data))
    if header != expected:
        raise BlockFileError(FileFault.CORRUPT, f"header {header} differs from the index's {expected}")
    payload = data[_HEADER_SIZE:]
    if _checksum(data[: _FIELDS.size], payload) != data[_FIELDS.size : _HEADER_SIZE]:
        raise BlockFileError(FileFault.CORRUPT, "checksum mismatch")
    return payload


@dataclass(frozen=True, slots=True)
class Scan:
    """What a directory of block files holds, as `scan` found it."""

    valid: list[BlockHeader]
    """This model's intact files, oldest first."""
    foreign_bytes: int
    """Bytes of other models' files (kept, not ours to delete)."""
    foreign: int
    """How many such files."""
    corrupt: int
    """Broken files found (and deleted)."""


def scan(directory: Path, digest: bytes) -> Scan:
    """Read the headers of every block file in `directory`; delete broken ones and leftover `.tmp` files."""
    for tmp in directory.glob("*.tmp"):
        tmp.unlink(missing_ok=True)
    valid: list[tuple[float, BlockHeader]] = []
    foreign_bytes = foreign = corrupt = 0
    for path in directory.glob(f"*{SUFFIX}"):
        try:
            valid.append((path.stat().st_mtime, read_header(path, digest)))
        except BlockFileError as exc:
            if exc.fault is FileFault.FOREIGN:
                foreign += 1
                foreign_bytes += path.stat().st_size
            else:
                corrupt += 1
                path.unlink(missing_ok=True)
        except OSError:
            corrupt += 1
    valid.sort(key=lambda item: item[0])
    return Scan([h for _, h in valid], foreign_bytes, foreign, corrupt)


def _checksum(fields: bytes, payload: bytes) -> bytes:
    h = hashlib.blake2b(fields, digest_size=32)
    h.update(payload)
    return h.digest()
