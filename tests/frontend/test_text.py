"""Tokenizer from the GGUF, incremental detokenization and stop strings (pure, no sockets)."""

from __future__ import annotations

import pytest

from dynamo_cli.frontend.stops import StopMatcher
from dynamo_cli.model.paths import resolve_model_path
from dynamo_cli.model.tokenizer import Tokenizer, load_tokenizer

SAMPLES = [
    "Héllo wörld 12345! 你好 🎉",
    "  leading spaces and\ttabs\n\nnewlines",
    "numbers 3.14159 and 1,000,000",
    "code: def f(x):\n    return x**2 # ok",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("smollm2")


@pytest.mark.parametrize("text", SAMPLES)
def test_streaming_detokenization_equals_whole_decoding_across_multibyte_characters(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    detok = tok.detokenizer()
    streamed = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert streamed == tok.decode(ids)
    assert "\ufffd" not in streamed


def test_an_emoji_split_over_tokens_is_never_emitted_half(tok: Tokenizer) -> None:
    ids = tok.encode("🎉")
    assert len(ids) > 1
    detok = tok.detokenizer()
    pieces = [detok.push([i]) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🎉"


def test_the_chat_template_comes_from_the_gguf(tok: Tokenizer) -> None:
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.encode("<|im_end|>") == [2] and 2 in tok.eos_token_ids


@pytest.mark.parametrize("text", SAMPLES)
def test_token_ids_are_the_same_as_llama_cpp_produces(tok: Tokenizer, text: str) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    model = llama_cpp.Llama(resolve_model_path("smollm2"), vocab_only=True, verbose=False)
    assert tok.encode(text) == model.tokenize(text.encode(), add_bos=False, special=True)


@pytest.mark.parametrize(
    ("stops", "pieces", "emitted", "stopped"),
    [
        pytest.param(["END"], ["hello E", "N", "D more"], "hello ", True, id="split-over-pieces"),
        pytest.param(["END"], ["aE", "Nx"], "aENx", False, id="false-start-released"),
        pytest.param(["\n\n", "###"], ["one\n", "\ntwo"], "one", True, id="first-of-several"),
        pytest.param([], ["a", "b"], "ab", False, id="no-stops"),
    ],
)
def test_stop_strings_hold_back_partial_matches(
    stops: list[str], pieces: list[str], emitted: str, stopped: bool
) -> None:
    matcher = StopMatcher(stops)
    out = ""
    for piece in pieces:
        out += matcher.push(piece)
        if matcher.stopped:
            break
    if not matcher.stopped:
        out += matcher.flush()
    assert (out, matcher.stopped) == (emitted, stopped)


@pytest.mark.parametrize(
    "text",
    [
        "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhi there 123<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|><|im_end|>",
        "no special tokens at all",
        "<|im_start|>user\n<|im_start|>",
    ],
)
def test_the_segment_cache_tokenizes_exactly_like_the_whole_prompt(tok: Tokenizer, text: str) -> None:
    whole = tok.hf.encode(text, add_special_tokens=False).ids
    assert tok.encode(text) == whole
    assert tok.encode(text) == whole  # second time from the cache
