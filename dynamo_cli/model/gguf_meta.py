"""Read a GGUF file's key-value metadata (tokenizer, chat template, context length) without its tensors.

GGUF v2/v3 layout: magic `GGUF`, u32 version, u64 tensor count, u64 kv count, then `kv count` pairs of
(string key, u32 type, value). Strings are u64 length + UTF-8 bytes; arrays are u32 item type, u64 count,
items. Only the header is read, so a 100 MB model opens in milliseconds.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from typing import Any, TypeVar

from dynamo_cli.errors import ConfigError

_SCALARS = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_STRING, _ARRAY = 8, 9
_T = TypeVar("_T")


class _Cursor:
    """A read position over the mapped file."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str, size: int) -> tuple[Any, ...]:
        if self.pos + size > len(self.buf):
            raise ValueError("truncated GGUF header")
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return out

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + n
        return str(self.buf[start : self.pos], "utf-8", errors="replace")


def _value(c: _Cursor, kind: int) -> Any:
    if kind == _STRING:
        return c.string()
    if kind == _ARRAY:
        item_kind, count = c.unpack("<IQ", 12)
        if item_kind in _SCALARS:
            fmt, size = _SCALARS[item_kind]
            return list(c.unpack(f"<{count}{fmt[1]}", size * count))
        if item_kind == _STRING:
            return [c.string() for _ in range(count)]
        return [_value(c, item_kind) for _ in range(count)]
    if kind not in _SCALARS:
        raise ValueError(f"unknown GGUF value type {kind}")
    fmt, size = _SCALARS[kind]
    return c.unpack(fmt, size)[0]


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """Every metadata key of the GGUF file at `path`; ConfigError when it is not a GGUF file."""
    return _read(path, _parse)


def read_gguf_vocab_size(path: str) -> int:
    """The vocabulary size of the GGUF file at `path` (`<arch>.vocab_size`, else the token list's
    length), reading no further than needed; ConfigError when it is not a GGUF file, 0 when absent."""
    return _read(path, _vocab_size)


def _read(path: str, reader: Callable[[str, _Cursor], _T]) -> _T:
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                return reader(path, _Cursor(view))
            finally:
                view.release()
    except (OSError, ValueError, struct.error) as exc:
        raise ConfigError(f"cannot read GGUF metadata from {path}: {exc}") from exc


def _vocab_size(path: str, c: _Cursor) -> int:
    num_kv = _header(path, c)
    for _ in range(num_kv):
        key = c.string()
        kind = c.unpack("<I", 4)[0]
        if key == "tokenizer.ggml.tokens" and kind == _ARRAY:
            _item_kind, count = c.unpack("<IQ", 12)
            return int(count)
        value = _value(c, kind)
        if key.endswith(".vocab_size"):
            return int(value)
    return 0


def _header(path: str, c: _Cursor) -> int:
    if bytes(c.buf[:4]) != b"GGUF":
        raise ConfigError(f"{path} is not a GGUF file (bad magic)")
    c.pos = 4
    version, _tensors, num_kv = c.unpack("<IQQ", 20)
    if version < 2:
        raise ConfigError(f"{path}: GGUF version {version} is too old; re-convert the model")
    return int(num_kv)


def _parse(path: str, c: _Cursor) -> dict[str, Any]:
    num_kv = _header(path, c)
    out: dict[str, Any] = {}
    for _ in range(num_kv):
        key = c.string()
        out[key] = _value(c, c.unpack("<I", 4)[0])
    return out
