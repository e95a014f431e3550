"""The word table (model/words.py) gives the tokenizer library's own ids, on any text, for both shapes of byte-level
BPE it takes (GPT-2's pre-tokenizer, and the GGUF's with digits isolated), and declines tokenizers it cannot copy."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HfTokenizer

from dynamo_cli.model.tokenizer import Tokenizer, load_tokenizer
from dynamo_cli.model.words import WordTable, slices

# Letters, digits, the whitespace GPT-2's pattern treats specially, apostrophes of its contractions, punctuation, and
# characters outside ASCII (which take the library's path) mixed in.
PLAIN = list("abcXYZ019 '  \t\n\r.,!?-_()[]{}<>|/\\\"#$%&*+=:;@^`~")
ALPHABET = st.sampled_from([*PLAIN, "é", "你", "🎉", "\x0b", "\x1c"])
TEXT = st.lists(st.one_of(ALPHABET, st.sampled_from(["'s", "'ll", "'re", " the", "  ", "\n\n", "12345", " 3.14"])))


@pytest.fixture(scope="module")
def gguf() -> Tokenizer:
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def gpt2(gguf: Tokenizer) -> HfTokenizer:
    """The same vocabulary behind GPT-2's own pre-tokenizer (no digit split): the shape of an HF directory's."""
    spec = json.loads(gguf.hf.to_str())
    spec["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return HfTokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module")
def gpt2_table(gpt2: HfTokenizer) -> WordTable:
    table = WordTable.of(gpt2)
    assert table is not None
    return table


def library(hf: HfTokenizer, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


@settings(max_examples=400, deadline=None)
@given(pieces=TEXT)
def test_the_gguf_tokenizer_gives_the_librarys_ids_on_any_text(gguf: Tokenizer, pieces: list[str]) -> None:
    text = "".join(pieces)
    assert gguf.words is not None
    assert gguf.encode(text) == library(gguf.hf, text)


@settings(max_examples=400, deadline=None)
@given(pieces=TEXT)
def test_gpt2s_pre_tokenizer_gives_the_librarys_ids_on_any_text(
    gpt2: HfTokenizer, gpt2_table: WordTable, pieces: list[str]
) -> None:
    text = "".join(pieces)
    ids = gpt2_table.encode(text)
    assert ids is None or ids == library(gpt2, text)
    if text.isascii() and all(c.isprintable() or c in "\t\n\r" for c in text):
        assert ids is not None  # plain text takes the fast path


@settings(max_examples=400, deadline=None)
@given(pieces=TEXT, size=st.integers(1, 12))
def test_a_text_cut_into_slices_has_the_ids_of_the_whole(
    gguf: Tokenizer, gpt2: HfTokenizer, gpt2_table: WordTable, pieces: list[str], size: int
) -> None:
    text = "".join(pieces)
    parts = slices(text, size)
    assert "".join(parts) == text
    for part in parts[:-1]:  # each cut before a space with something other than whitespace on both sides
        assert len(part) >= size and not part[-1].isspace()
    plain = WordTable.is_plain(text)
    for hf, table in ((gguf.hf, gguf.words), (gpt2, gpt2_table)):
        assert table is not None
        got = [table.encode(part) if plain else library(hf, part) for part in parts]
        assert [i for ids in got for i in (ids or [])] == library(hf, text)


def test_a_long_prompt_is_tokenized_in_slices_the_event_loop_running_between(gguf: Tokenizer) -> None:
    text = " ".join(f"slice{i % 89} {i}, it's {i * 7 % 13}." for i in range(3000))  # ~66,000 characters
    text = text[:30000]
    ticks = 0

    async def main() -> list[int]:
        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        ticks_before = ticks
        try:
            ids = await gguf.encode_async(text)
        finally:
            ticker.cancel()
        assert ticks - ticks_before >= 10  # 30,000 characters in slices of 2,048: the loop ran between them
        return ids

    assert asyncio.run(main()) == library(gguf.hf, text)


def test_long_prompts_tokenized_at_once_finish_in_the_order_they_came(gguf: Tokenizer) -> None:
    texts = [" ".join(f"lane{k}w{i}" for i in range(2500 if k == 0 else 400)) for k in range(3)]  # 20,000; 3,000
    done: list[int] = []

    async def one(k: int) -> None:
        assert await gguf.encode_async(texts[k]) == library(gguf.hf, texts[k])
        done.append(k)

    async def main() -> None:
        await asyncio.gather(*(one(k) for k in range(3)))

    asyncio.run(main())
    assert done == [0, 1, 2]


def test_a_long_prompt_of_words_and_numbers_matches_and_comes_from_the_table(gguf: Tokenizer) -> None:
    text = " ".join(f"word{i % 97} {i}, it's {i * 7 % 13}." for i in range(2000))
    assert gguf.encode(text) == library(gguf.hf, text)
    assert gguf.words is not None and gguf.words.encode(text) == library(gguf.hf, text)


def test_threads_sharing_the_table_get_the_same_ids(gguf: Tokenizer) -> None:
    texts = [" ".join(f"t{j}x{i}" for i in range(300)) for j in range(8)]
    want = [library(gguf.hf, t) for t in texts]
    got: list[list[list[int]]] = [[] for _ in range(4)]

    def run(k: int) -> None:
        got[k] = [gguf.encode(t) for t in texts]

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(g == want for g in got)


@pytest.mark.parametrize(
    "change",
    [
        {"normalizer": {"type": "NFC"}},
        {"pre_tokenizer": {"type": "Whitespace"}},
        {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}},
    ],
    ids=["a-normalizer", "another-pre-tokenizer", "prefix-space"],
)
def test_a_tokenizer_of_another_shape_keeps_the_librarys_path(gguf: Tokenizer, change: dict[str, object]) -> None:
    spec = {**json.loads(gguf.hf.to_str()), **change}
    assert WordTable.of(HfTokenizer.from_str(json.dumps(spec))) is None


def test_a_non_special_added_token_keeps_the_librarys_path(gguf: Tokenizer, tmp_path: Path) -> None:
    spec = json.loads(gguf.hf.to_str())
    spec["added_tokens"].append({**spec["added_tokens"][0], "id": 0, "content": "zz", "special": False})
    assert WordTable.of(HfTokenizer.from_str(json.dumps(spec))) is None
