"""Byte-level BPE a word at a time, with the words' ids kept: the exact ids of the model's tokenizer, at a fraction of
its cost on plain text.

NOTE: the `tokenizers` library spends most of a long prompt's time in its pre-tokenizer (GPT-2's regular expression,
about 6 us a token on these CPUs: 12 ms for a 1,700-token prompt), not in BPE, which it caches per word. A byte-level
BPE never merges across pre-token boundaries, so a text's ids are the concatenation of its pre-tokens' ids. For text
of printable ASCII (plus tab, newline, carriage return) GPT-2's pattern has an exact ASCII form, which Python's `re`
runs in C; each distinct pre-token is then encoded once by the library itself and its ids kept. Text with any other
character, and tokenizers of another shape (a normalizer, another pre-tokenizer, added tokens that are not special),
keep the library's own path. `tests/model/test_words.py` checks the two paths agree on random text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from tokenizers import Encoding
from tokenizers import Tokenizer as HfTokenizer

MAX_WORDS = 1 << 18
"""Distinct pre-tokens whose ids are kept (about 40 MB at most); the table starts afresh when full."""

_LETTERS, _DIGITS, _SPACE = "A-Za-z", "0-9", r" \t\n\r"
# GPT-2's pattern ('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+), for ASCII text.
_GPT2 = (
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{_LETTERS}]+| ?[{_DIGITS}]+| ?[^{_SPACE}{_LETTERS}{_DIGITS}]+"
    rf"|[{_SPACE}]+(?![^{_SPACE}])|[{_SPACE}]+"
)
# The GGUF's: every digit split off first (Split \p{N} isolated), then GPT-2's pattern on the text between digits. In
# one pattern: a digit is a piece, and a digit ends a run of spaces as the end of the text does.
_GPT2_DIGITS = (
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{_LETTERS}]+|[{_DIGITS}]| ?[^{_SPACE}{_LETTERS}{_DIGITS}]+"
    rf"|[{_SPACE}]+(?![^{_SPACE}{_DIGITS}])|[{_SPACE}]+"
)
_NOT_PLAIN = re.compile(r"[^\x20-\x7e\t\n\r]").search
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
_DIGITS_ISOLATED = {"type": "Split", "pattern": {"Regex": "\\p{N}"}, "behavior": "Isolated", "invert": False}


def batch_encoder(hf: HfTokenizer) -> Callable[..., list[Encoding]]:
    """The library's batch encode: it releases the GIL (`encode` does not), and the `_fast` form skips computing
    offsets (about a third cheaper, the same ids)."""
    return getattr(hf, "encode_batch_fast", hf.encode_batch)


def plain_ids(words: WordTable | None, encode: Callable[..., list[Encoding]], text: str) -> list[int]:
    """The ids of `text` (no special token in it): from the word table when it takes the text, else the library's."""
    ids = words.encode(text) if words is not None else None
    return ids if ids is not None else encode([text], add_special_tokens=False)[0].ids


def slices(text: str, size: int) -> list[str]:
    """`text` cut into pieces of about `size` characters whose ids, put together, are the ids of `text` (plain text).

    NOTE: a cut goes before a space that has something other than whitespace on both sides. In both patterns above,
    the piece holding the character before the cut cannot hold the space (letters, digits and punctuation runs stop
    at a space; contractions hold none; that character is no whitespace), so a piece ends at the cut in the whole
    text as in the first part; and what the pattern matches from the cut on (a space and a word) looks at nothing
    before it. A text with no such space stays whole."""
    out: list[str] = []
    start, end = 0, len(text)
    while end - start > size:
        cut = text.find(" ", start + size, end - 1)
        while cut > 0 and (text[cut - 1].isspace() or text[cut + 1].isspace()):
            cut = text.find(" ", cut + 1, end - 1)
        if cut <= 0:
            break
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


class WordTable:
    """The ids of a byte-level BPE tokenizer's pre-tokens, encoded once each (thread-safe: a lost race encodes a word
    twice, to the same ids)."""

    def __init__(self, hf: HfTokenizer, isolate_digits: bool) -> None:
        self._encode = batch_encoder(hf)
        self._single: dict[str, int] = {}
        """Pre-tokens that are one token (most of them), looked up in C for a whole text at once."""
        self._multi: dict[str, list[int]] = {}
        self._pieces = re.compile(_GPT2_DIGITS if isolate_digits else _GPT2).findall

    @classmethod
    def of(cls, hf: HfTokenizer) -> WordTable | None:
        """A table for `hf` when its shape is one this module reproduces exactly, else None."""
        spec = json.loads(hf.to_str())
        if spec.get("normalizer") is not None or (spec.get("model") or {}).get("type") != "BPE":
            return None
        if any(not token.get("special") for token in spec.get("added_tokens") or ()):
            return None  # a non-special added token matches anywhere in the text, before pre-tokenizing
        pre = spec.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
        if not steps or not _is_byte_level(steps[-1]):
            return None
        if steps[:-1] == [_DIGITS_ISOLATED]:
            return cls(hf, isolate_digits=True)
        return cls(hf, isolate_digits=False) if len(steps) == 1 else None

    @staticmethod
    def is_plain(text: str) -> bool:
        """Whether `encode` takes `text` (printable ASCII, tab, newline, carriage return)."""
        return _NOT_PLAIN(text) is None

    def encode(self, text: str) -> list[int] | None:
        """The ids of `text` (no special token in it), or None when it is not plain ASCII."""
        if _NOT_PLAIN(text):
            return None
        pieces = self._pieces(text)
        ids: list[int | None] = list(map(self._single.get, pieces))
        if None not in ids:
            return ids  # type: ignore[return-value]
        return self._slow(pieces, ids)

    def _slow(self, pieces: list[str], ids: list[int | None]) -> list[int]:
        """Pieces of several tokens, or not seen yet (encoded by the library once, then kept)."""
        single, multi = self._single, self._multi
        missing = list(dict.fromkeys(p for p, i in zip(pieces, ids, strict=True) if i is None and p not in multi))
        if missing:
            if len(single) + len(multi) + len(missing) > MAX_WORDS:
                single.clear()
                multi.clear()
            for piece, encoding in zip(missing, self._encode(missing, add_special_tokens=False), strict=True):
                got = encoding.ids
                if len(got) == 1:
                    single[piece] = got[0]
                else:
                    multi[piece] = got
        out: list[int] = []
        for piece, i in zip(pieces, ids, strict=True):
            if i is not None:
                out.append(i)
            elif (one := single.get(piece)) is not None:
                out.append(one)
            else:
                out += multi.get(piece) or self._encode([piece], add_special_tokens=False)[0].ids
        return out


def _is_byte_level(step: dict[str, object]) -> bool:
    return step.get("type") == "ByteLevel" and all(step.get(k) == v for k, v in _BYTE_LEVEL.items())
