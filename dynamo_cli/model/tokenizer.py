"""A model's tokenizer and chat template, from a GGUF file or a directory with tokenizer.json.

The frontend tokenizes and applies the chat template; workers see token ids only. For GGUF models the
vocabulary, merges, special tokens and template come from the file's metadata, so the ids the frontend
sends are the model's own (the same ids llama.cpp would produce).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Encoding, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HfTokenizer

from dynamo_cli.errors import ConfigError
from dynamo_cli.model.chat_template import ChatTemplate
from dynamo_cli.model.detokenizer import ByteDetokenizer, Detokenizer, TextDetokenizer
from dynamo_cli.model.paths import resolve_model_path
from dynamo_cli.model.words import WordTable, batch_encoder, plain_ids, slices

_CONTROL = 3  # GGUF token_type of special/control tokens
_USER_DEFINED = 4

SEGMENT_CACHE = 4096
"""Text segments (between special tokens) whose ids are kept: system prompts, earlier turns."""
SEGMENT_CACHE_TOKENS = 1 << 20
"""...and the most token ids they hold together (about 40 MB): a stream of long unique prompts does not fill memory."""
INLINE_CHARS = 2048
"""Texts up to this long are tokenized at once on the caller's thread (the library: about 2 ms here). A longer text
that is not plain goes to a tokenizer thread, so a burst of long prompts neither blocks the event loop (every other
stream's chunks wait behind it) nor runs one prompt at a time: `encode_batch` releases the GIL, so two threads
tokenize two prompts at once."""
SLICE_CHARS = 2048
"""Longer plain text is tokenized by the word table (model/words.py: about 0.15 us a character, in Python, holding
the GIL, so a thread would not free the loop) in slices of about this many characters, a third of a millisecond
each, the event loop running between two: a 3,000-token prompt took 2-3 ms of the loop at once, and every stream's
next chunk waited behind it (the disaggregated ITL p99 in benchmarks/RESULTS.md)."""
TOKENIZER_THREADS = 2
"""Tokenizer threads per process (the engines' own cores do the rest)."""


@dataclass(frozen=True, slots=True)
class Tokenizer:
    """Encode/decode, special ids and the chat template of one model."""

    hf: HfTokenizer
    template: ChatTemplate | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    token_bytes: tuple[bytes, ...] | None
    """Per-id raw bytes for byte-level BPE (fast incremental detokenization); None otherwise."""
    segments: SegmentCache | None = None
    """Exact segment cache; None when the model has no special tokens to split on."""
    words: WordTable | None = None
    """Plain text a word at a time (model/words.py); None for a tokenizer of another shape."""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, special tokens recognised, no BOS added."""
        if self.segments is not None:
            return self.segments.encode(text)
        return plain_ids(self.words, batch_encoder(self.hf), text)

    async def encode_async(self, text: str) -> list[int]:
        """`encode`, the event loop going on meanwhile for a long text: plain text in slices (SLICE_CHARS), one
        prompt after another in arrival order; any other on a tokenizer thread."""
        if len(text) <= INLINE_CHARS:
            return self.encode(text)
        if self.words is not None and self.words.is_plain(text):
            if self.segments is not None:
                return await self.segments.encode_sliced(text)
            return await sliced_ids(self.words, batch_encoder(self.hf), text)
        return await asyncio.get_running_loop().run_in_executor(_pool(), self.encode, text)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens skipped."""
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """Render the conversation, the generation prompt appended unless asked not to (`tools` for a template
        that has them)."""
        if self.template is None:
            turns = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return turns + "assistant: " if add_generation_prompt else turns
        return self.template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)

    def detokenizer(self) -> Detokenizer:
        """A fresh incremental detokenizer for one stream."""
        if self.token_bytes is not None:
            return ByteDetokenizer(self.token_bytes)
        return TextDetokenizer(self.hf)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)


class SegmentCache:
    """Exact tokenization with a cache: special tokens are atomic (the tokenizer splits on them before
    anything else), so the text between two of them tokenizes the same alone as in the whole prompt.
    A chat's system prompt and earlier turns are then tokenized once, not on every request.
    """

    def __init__(self, hf: HfTokenizer, specials: dict[str, int], words: WordTable | None = None) -> None:
        import re
        from collections import OrderedDict

        self._hf = hf
        self._words = words
        self._specials = specials
        longest_first = sorted(specials, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(s) for s in longest_first) + ")").split
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._num_tokens = 0
        self._lock = threading.Lock()
        """Held around the cache's bookkeeping, never around tokenizing: tokenizer threads share the cache."""
        self._encode = batch_encoder(hf)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece, hit in self._lookup(text):
            if hit is None:
                hit = plain_ids(self._words, self._encode, piece)
                with self._lock:
                    self._keep(piece, hit)
            ids += hit
        return ids

    async def encode_sliced(self, text: str) -> list[int]:
        """`encode` of plain text, each piece not cached tokenized by `sliced_ids`."""
        assert self._words is not None
        ids: list[int] = []
        for piece, hit in self._lookup(text):
            if hit is None:
                hit = await sliced_ids(self._words, self._encode, piece)
                with self._lock:
                    self._keep(piece, hit)
            ids += hit
        return ids

    def _lookup(self, text: str) -> list[tuple[str, list[int] | None]]:
        """The text's pieces between special tokens, each with its ids when known (a special token's, or cached)."""
        out: list[tuple[str, list[int] | None]] = []
        cache, specials = self._cache, self._specials
        with self._lock:
            for i, piece in enumerate(self._split(text)):
                if i % 2:
                    out.append((piece, [specials[piece]]))
                elif piece:
                    hit = cache.get(piece)
                    if hit is not None:
                        cache.move_to_end(piece)
                    out.append((piece, hit))
        return out

    def _keep(self, piece: str, ids: list[int]) -> None:
        cache = self._cache
        if piece in cache or len(ids) > SEGMENT_CACHE_TOKENS // 8:
            return
        cache[piece] = ids
        self._num_tokens += len(ids)
        while len(cache) > SEGMENT_CACHE or self._num_tokens > SEGMENT_CACHE_TOKENS:
            self._num_tokens -= len(cache.popitem(last=False)[1])


_LANES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()
"""Per event loop: held while a long text is tokenized in slices, so prompts finish in the order they came (taking
turns slice by slice, a burst of arrivals would all finish at the end of the burst)."""


async def sliced_ids(words: WordTable, encode: Callable[..., list[Encoding]], text: str) -> list[int]:
    """The ids of plain `text` (no special token in it), SLICE_CHARS at a time, the event loop running between two
    slices, one text at a time per loop (`_LANES`)."""
    parts = slices(text, SLICE_CHARS)
    if len(parts) == 1:
        return plain_ids(words, encode, text)
    loop = asyncio.get_running_loop()
    lane = _LANES.get(loop)
    if lane is None:
        lane = _LANES[loop] = asyncio.Lock()
    ids: list[int] = []
    async with lane:
        for i, part in enumerate(parts):
            if i:
                await asyncio.sleep(0)
            ids += plain_ids(words, encode, part)
    return ids


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """The process's tokenizer threads, started at the first long text (they end with the process)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="dyn-tokenize")
        return _POOL


def _segment_cache(hf: HfTokenizer, words: WordTable | None) -> SegmentCache | None:
    specials = {t.content: i for i, t in hf.get_added_tokens_decoder().items() if t.special}
    return SegmentCache(hf, specials, words) if specials else None


def _tokenizer(
    hf: HfTokenizer,
    template: ChatTemplate | None,
    eos_token_ids: tuple[int, ...],
    bos_token_id: int | None,
    token_bytes: tuple[bytes, ...] | None,
) -> Tokenizer:
    words = WordTable.of(hf)
    return Tokenizer(hf, template, eos_token_ids, bos_token_id, token_bytes, _segment_cache(hf, words), words)


def load_tokenizer(source: str) -> Tokenizer:
    """Load from a `.gguf` file or an HF-style directory (`tokenizer.json` + `tokenizer_config.json`)."""
    path = resolve_model_path(source)
    if path.endswith(".gguf"):
        return _from_gguf(path)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "tokenizer.json")):
        return _from_dir(path)
    raise ConfigError(f"no tokenizer at {path}: expected a .gguf file or a directory with tokenizer.json")


##### GGUF #####


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = visible[:]
    n = 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(visible, chars, strict=True)}


def _cache_path(path: str) -> Path:
    st = os.stat(path)
    key = hashlib.sha256(f"{path}:{st.st_size}:{st.st_mtime_ns}:v1".encode()).hexdigest()[:24]
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dyn" / "tokenizers"
    return root / f"{key}.json"


def _from_gguf(path: str) -> Tokenizer:
    cache = _cache_path(path)
    if cache.exists():
        saved = json.loads(cache.read_text())
        hf = HfTokenizer.from_str(saved["tokenizer"])
        meta = saved["meta"]
    else:
        from dynamo_cli.model.gguf_meta import read_gguf_metadata

        full = read_gguf_metadata(path)
        hf = _build_bpe(path, full)
        meta = {k: v for k, v in full.items() if not k.startswith("tokenizer.ggml.") or "_id" in k}
        meta["special"] = [i for i, t in enumerate(full["tokenizer.ggml.token_type"]) if t == _CONTROL]
        _save_cache(cache, hf, meta)
    return _assemble(hf, meta)


def _save_cache(cache: Path, hf: HfTokenizer, meta: dict[str, Any]) -> None:
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"tokenizer": hf.to_str(), "meta": meta}))
        tmp.replace(cache)
    except OSError:
        pass  # a read-only home only costs the next start a re-parse


def _build_bpe(path: str, meta: dict[str, Any]) -> HfTokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(f"{path}: tokenizer model '{kind}' is not supported yet (only byte-level BPE 'gpt2')")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    hf = HfTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    # llama.cpp's 'smollm' / 'starcoder' pre-tokenizer: digits one by one, then GPT-2's byte-level regex.
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    types = meta["tokenizer.ggml.token_type"]
    specials = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _CONTROL]
    hf.add_special_tokens(specials)
    user = [AddedToken(tokens[i], normalized=False) for i, t in enumerate(types) if t == _USER_DEFINED]
    if user:
        hf.add_tokens(user)
    return hf


def _assemble(hf: HfTokenizer, meta: dict[str, Any]) -> Tokenizer:
    decoder = _byte_decoder()
    special = set(meta["special"])
    table = []
    for i in range(hf.get_vocab_size(with_added_tokens=True)):
        piece = hf.id_to_token(i) or ""
        table.append(b"" if i in special else bytes(decoder.get(ch, 0x3F) for ch in piece))
    vocab = hf.get_vocab(with_added_tokens=True)
    id_to_text = {v: k for k, v in vocab.items()}
    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos_ids = {eos} if eos is not None else set()
    end_turn = vocab.get("<|im_end|>")
    if end_turn is not None:
        eos_ids.add(end_turn)  # ChatML models end a turn with <|im_end|>
    template_src = meta.get("tokenizer.chat_template")
    template = None
    if template_src:
        template = ChatTemplate(
            template_src,
            bos_token=id_to_text.get(bos, "") if bos is not None else "",
            eos_token=id_to_text.get(eos, "") if eos is not None else "",
        )
    return _tokenizer(hf, template, tuple(sorted(eos_ids)), bos, tuple(table))


##### HF directory #####


def _from_dir(path: str) -> Tokenizer:
    hf = HfTokenizer.from_file(os.path.join(path, "tokenizer.json"))
    config: dict[str, Any] = {}
    config_path = os.path.join(path, "tokenizer_config.json")
    if os.path.exists(config_path):
        config = json.loads(Path(config_path).read_text())

    def token_text(value: Any) -> str:
        return str(value.get("content", "")) if isinstance(value, dict) else str(value or "")

    eos_text, bos_text = token_text(config.get("eos_token")), token_text(config.get("bos_token"))
    eos_ids = tuple(i for i in (hf.token_to_id(eos_text),) if i is not None) if eos_text else ()
    bos_id = hf.token_to_id(bos_text) if bos_text else None
    template_src = config.get("chat_template")
    if template_src is None and os.path.exists(os.path.join(path, "chat_template.jinja")):
        template_src = Path(path, "chat_template.jinja").read_text()
    template = ChatTemplate(template_src, bos_token=bos_text, eos_token=eos_text) if template_src else None
    return _tokenizer(hf, template, eos_ids, bos_id, None)
