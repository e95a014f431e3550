"""Workloads: the prompts a benchmark sends, built so that their token counts are exact.

NOTE: prompts are sequences of *vocabulary words*: tokens whose text is a space followed by letters and
which encode back to exactly that one token. A byte-level BPE never merges across a leading space, so a
prompt of n such words is n tokens, and joining two prompts' texts joins their token sequences. That is
what lets a shared prefix be shared exactly, and a Mooncake block (512 tokens) be the same text wherever
its hash id appears. Without the model's tokenizer the words are made up and "1 word = 1 token" is only
an approximation; `Vocab.source` says which was used and the report prints it.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import msgspec

from dynamo_cli.errors import ConfigError

logger = logging.getLogger(__name__)

_WORD = re.compile(r"^ ?[A-Za-z]{2,12}$")
_MIN_WORDS = 256


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class Vocab:
    """Single-token words to build prompts from, and how output text is counted."""

    words: tuple[str, ...]
    """Each starts with a space and is exactly one token (approximately, when `is_exact` is False)."""
    is_exact: bool
    """True when built from the served model's tokenizer."""
    source: str
    """Where the words came from, for the report."""
    count_tokens: Callable[[str], int]
    """Counts the tokens of a text (the tokenizer's, or a word count when approximate)."""


@dataclass(frozen=True, slots=True)
class Turn:
    """One user message of a conversation."""

    text: str
    """The prompt content."""
    input_tokens: int
    """Its length in tokens (exact with the model's tokenizer)."""
    output_tokens: int
    """max_tokens to ask for (with ignore_eos, the output length)."""
    images: tuple[str, ...] = ()
    """Images (data: URLs) sent after the text; `input_tokens` counts the text only."""
    gap_s: float = 0.0
    """Seconds to wait, after the previous turn's answer, before sending this one (an agent's tool time)."""
    extra: dict[str, Any] | None = None
    """Fields added to this turn's request body (an agent call's `nvext.agent_hints`)."""


@dataclass(frozen=True, slots=True)
class Conversation:
    """One or more turns sent one after the other, each with the previous answers as history."""

    turns: tuple[Turn, ...]
    """The user turns, in order."""
    at: float | None = None
    """Send time in seconds after the run starts (trace replay), or None to follow the load mode."""
    system: str | None = None
    """A system prompt sent before the first turn (an agent's), or None."""
    headers: tuple[tuple[str, str], ...] = ()
    """HTTP headers every request of it carries (an agent's session id, a tenant's name, key and class)."""
    tenant: str | None = None
    """The tenant it is sent as, recorded on each of its requests for the per-tenant report."""


def load_vocab(tokenizer: str | None) -> Vocab:
    """Build the word list from the model's tokenizer (alias or path); fall back to an approximation."""
    if tokenizer:
        try:
            from dynamo_cli.model.paths import resolve_model_path
            from dynamo_cli.model.tokenizer import load_tokenizer

            tok = load_tokenizer(resolve_model_path(tokenizer))
            words = vocab_words(tok)
        except Exception as exc:  # a missing module, a bad path, an odd vocabulary: say so and go on
            logger.warning("tokenizer %r unusable (%s); falling back to an approximation", tokenizer, exc)
            return approximate_vocab(f"approximate (1 word ≈ 1 token): tokenizer {tokenizer!r} failed: {exc}")
        if len(words) >= _MIN_WORDS:
            return Vocab(tuple(words), True, f"tokenizer {tokenizer}", lambda text: len(tok.encode(text)))
        return approximate_vocab(f"approximate (1 word ≈ 1 token): tokenizer {tokenizer!r} has too few words")
    return approximate_vocab("approximate (1 word ≈ 1 token): no --tokenizer given")


def vocab_words(tok: TextCodec, limit: int = 200_000) -> list[str]:
    """The single-token space-prefixed words of a tokenizer's vocabulary, verified by re-encoding."""
    size = getattr(tok, "vocab_size", None)
    limit = size if isinstance(size, int) and size > 0 else limit
    candidates: list[str] = []
    seen: set[str] = set()
    for token_id in range(limit):
        try:
            text = tok.decode([token_id])
        except Exception:
            break  # past the end of the vocabulary
        if _WORD.match(text):
            word = " " + text.strip()
            if word not in seen:
                seen.add(word)
                candidates.append(word)
    if len(tok.encode("".join(candidates))) == len(candidates):
        return candidates
    return [w for w in candidates if len(tok.encode(w)) == 1 and len(tok.encode(w + w)) == 2]


def approximate_vocab(source: str) -> Vocab:
    """Made-up words from syllables; counting words approximates counting tokens."""
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "si", "pe", "da", "fu", "gi", "ho", "ja", "be"]
    words = tuple(f" {a}{b}{c}" for a in syllables for b in syllables for c in syllables)
    return Vocab(words, False, source, lambda text: len(text.split()))


def draw_length(rng: random.Random, mean: float, stddev: float) -> int:
    """A length of mean ± stddev (normal), at least 1."""
    return max(1, round(rng.gauss(mean, stddev))) if stddev > 0 else max(1, round(mean))


class WordPool:
    """Random words drawn once; a prompt body is a slice at a random offset (C-speed, no per-word RNG)."""

    def __init__(self, vocab: Vocab, rng: random.Random, size: int = 1 << 16) -> None:
        self.rng = rng
        self.words = rng.choices(vocab.words, k=size)

    def take(self, n: int) -> list[str]:
        words, size = self.words, len(self.words)
        start = self.rng.randrange(size)
        if start + n <= size:
            return words[start : start + n]
        out = words[start:]
        while len(out) < n:
            out += words[: n - len(out)]
        return out


def marker(vocab: Vocab, index: int) -> list[str]:
    """A word sequence unique to `index`: one word while the vocabulary lasts, then two, then more (bijective
    base-n digits, lowest first)."""
    words, n = vocab.words, len(vocab.words)
    out = [words[index % n]]
    index //= n
    while index:
        out.append(words[(index - 1) % n])
        index = (index - 1) // n
    return out


def synthetic(
    vocab: Vocab,
    isl: float,
    isl_stddev: float,
    osl: float,
    osl_stddev: float,
    turns: int = 1,
    seed: int = 0,
    offset: int = 0,
) -> Iterator[Conversation]:
    """Endless random prompts of ISL ± stddev tokens; each starts with its own marker so none share."""
    rng = random.Random(seed)
    pool = WordPool(vocab, rng)
    index = offset
    while True:
        built = []
        for _ in range(turns):
            n = draw_length(rng, isl, isl_stddev)
            words = marker(vocab, index)[:n]
            index += 1
            words += pool.take(n - len(words))
            built.append(Turn("".join(words), n, draw_length(rng, osl, osl_stddev)))
        yield Conversation(tuple(built))


def shared_prefix(
    vocab: Vocab,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    osl: float,
    osl_stddev: float,
    seed: int = 0,
) -> Iterator[Conversation]:
    """Prompt i = prefix of group i mod num_prefixes + a suffix; exactly `prefix_len` tokens are shared.

    Each prefix starts with a marker unique to its group and each suffix with a marker unique to its
    prompt, so prompts of one group share the prefix and nothing more, and other groups share nothing.
    """
    if num_prefixes < 1 or prefix_len < 1 or suffix_len < 1:
        raise ConfigError("shared prefix needs --num-prefixes, --prefix-len and --suffix-len ≥ 1")
    rng = random.Random(seed)
    prefixes = []
    for group in range(num_prefixes):
        head = marker(vocab, group)[:prefix_len]
        prefixes.append("".join(head + rng.choices(vocab.words, k=prefix_len - len(head))))
    pool = WordPool(vocab, rng)
    index = 0
    while True:
        tail = marker(vocab, num_prefixes + index)[:suffix_len]
        suffix = "".join(tail + pool.take(suffix_len - len(tail)))
        text = prefixes[index % num_prefixes] + suffix
        yield Conversation((Turn(text, prefix_len + suffix_len, draw_length(rng, osl, osl_stddev)),))
        index += 1


class TraceEntry(msgspec.Struct):
    """One line of a Mooncake trace (timestamp in milliseconds)."""

    timestamp: float = 0.0
    input_length: int = 0
    output_length: int = 1
    hash_ids: list[int] = []


def read_trace(path: str) -> list[TraceEntry]:
    """Parse a Mooncake JSONL trace; raises ConfigError naming the bad line."""
    decoder = msgspec.json.Decoder(TraceEntry)
    entries = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"--trace {path}: {exc.strerror}") from None
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                entries.append(decoder.decode(line))
            except msgspec.ValidationError as exc:
                raise ConfigError(f"--trace {path} line {number}: {exc}") from None
            except msgspec.DecodeError:
                raise ConfigError(f"--trace {path} line {number} is not JSON") from None
    return entries


def trace_block(vocab: Vocab, hash_id: int, block_size: int, seed: int) -> list[str]:
    """The words of one hash block: a function of (seed, hash_id) only, so equal ids give equal text."""
    return random.Random(f"{seed}:{hash_id}").choices(vocab.words, k=block_size)


def trace_replay(
    vocab: Vocab,
    entries: Sequence[TraceEntry],
    time_scale: float = 1.0,
    block_size: int = 512,
    seed: int = 0,
) -> Iterator[Conversation]:
    """Replay a trace: request i is sent at timestamp_i × time_scale (ms → s) after the first entry."""
    if not entries:
        return
    origin = min(e.timestamp for e in entries)
    rng = random.Random(seed)
    blocks: dict[int, list[str]] = {}
    for entry in entries:
        words: list[str] = []
        for hash_id in entry.hash_ids:
            if len(words) >= entry.input_length:
                break
            if hash_id not in blocks:
                blocks[hash_id] = trace_block(vocab, hash_id, block_size, seed)
            words += blocks[hash_id]
        words = words[: entry.input_length]
        words += rng.choices(vocab.words, k=max(0, entry.input_length - len(words)))
        turn = Turn("".join(words), entry.input_length, max(1, entry.output_length))
        yield Conversation((turn,), at=(entry.timestamp - origin) / 1e3 * time_scale)


class ImageMaker:
    """Random square PNGs as data: URLs: a share of them drawn from a pool of `pool` (repeated), the rest new."""

    def __init__(self, side: int, repeat: float, pool: int, seed: int) -> None:
        self.side, self.repeat = side, repeat
        self.rng = random.Random(f"images:{seed}")
        self.pool = [self._new() for _ in range(pool)] if repeat > 0 else []

    def next(self) -> str:
        if self.pool and self.rng.random() < self.repeat:
            return self.rng.choice(self.pool)
        return self._new()

    def _new(self) -> str:
        import base64
        import io

        from PIL import Image

        out = io.BytesIO()
        pixels = self.rng.randbytes(self.side * self.side * 3)  # noise: every image distinct, incompressible
        Image.frombytes("RGB", (self.side, self.side), pixels).save(out, format="PNG")
        return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def with_images(conversations: Iterator[Conversation], maker: ImageMaker, per_turn: int) -> Iterator[Conversation]:
    """`conversations` with `per_turn` images on every user turn."""
    for conversation in conversations:
        turns = tuple(replace(t, images=tuple(maker.next() for _ in range(per_turn))) for t in conversation.turns)
        yield replace(conversation, turns=turns)


def prompts_file(path: str, osl: float, osl_stddev: float, vocab: Vocab, seed: int = 0) -> Iterator[Conversation]:
    """Cycle through a file of prompts: JSONL with "text"/"prompt" fields, or one prompt per line."""
    try:
        lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise ConfigError(f"--prompts-file {path}: {exc.strerror}") from None
    if not lines:
        raise ConfigError(f"--prompts-file {path} has no prompts")
    texts = [_prompt_text(line) for line in lines]
    rng = random.Random(seed)
    while True:
        for text in texts:
            yield Conversation((Turn(text, vocab.count_tokens(text), draw_length(rng, osl, osl_stddev)),))


def _prompt_text(line: str) -> str:
    if line.lstrip().startswith("{"):
        try:
            doc: Any = msgspec.json.decode(line)
        except msgspec.DecodeError:
            return line
        for key in ("text", "prompt", "input", "text_input"):
            if isinstance(doc, dict) and isinstance(doc.get(key), str):
                return str(doc[key])
    return line
