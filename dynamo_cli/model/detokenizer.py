"""Incremental detokenization: new token ids in, new text out, correct across multi-byte characters."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Protocol

from tokenizers import Tokenizer as HfTokenizer


class Detokenizer(Protocol):
    """Turns a stream of token ids into a stream of text pieces."""

    def push(self, token_ids: Sequence[int]) -> str:
        """Text completed by these tokens (may be empty while a character is incomplete)."""
        ...

    def flush(self) -> str:
        """Whatever is held back at the end of the stream."""
        ...


class ByteDetokenizer:
    """Byte-level BPE: every id maps to raw bytes; an incremental UTF-8 decoder joins them.

    O(1) per token with no re-decoding of the tail, unlike the offset-window method.
    """

    __slots__ = ("_table", "_utf8")

    def __init__(self, token_bytes: tuple[bytes, ...]) -> None:
        self._table = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: Sequence[int]) -> str:
        table = self._table
        size = len(table)
        data = b"".join([table[t] if 0 <= t < size else b"" for t in token_ids])
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class TextDetokenizer:
    """Any tokenizer: decode a sliding window and emit the stable new suffix (vLLM's method)."""

    __slots__ = ("_hf", "_ids", "_prefix", "_read")

    def __init__(self, hf: HfTokenizer) -> None:
        self._hf = hf
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        before = self._hf.decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        after = self._hf.decode(self._ids[self._prefix :], skip_special_tokens=True)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def flush(self) -> str:
        before = self._hf.decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        after = self._hf.decode(self._ids[self._prefix :], skip_special_tokens=True)
        self._read = len(self._ids)
        return after[len(before) :] if len(after) > len(before) else ""
