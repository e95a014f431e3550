"""vLLM data parallelism for real: one engine of two ranks (`data_parallel_size=2`) on vLLM's CPU build.

Runs wherever vLLM imports. Each rank is an engine core of its own, pinned to its own core
(`VLLM_CPU_OMP_THREADS_BIND="0|1"`) with an explicit KV size (`kv_cache_memory_bytes`, and `VLLM_CPU_KVCACHE_SPACE`
for any vLLM that reads only that), float32 and eager on the built-in SmolLM2 exported to an HF folder, as the other
vLLM tests do. The test pins requests to ranks and reads the ranks' KV events: a request pinned to rank 1 runs there
(its blocks come stamped rank 1), rank 0 serves too, and a repeated prefix is a cache hit on the rank that holds it
only.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util

import pytest
from dyn_engines.vllm.engine import VllmEngine

from dynamo_cli.engine import EngineArgs
from dynamo_cli.kv.events import BlockStored, KvEventBatch
from dynamo_cli.kv.hashing import sequence_hashes
from dynamo_cli.wire import GenerateRequest, SamplingParams
from tests.conftest import VLLM_TEST_EXTRA

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm: pip install 'dynamo-cli[vllm]'"),
    pytest.mark.slow,
    pytest.mark.timeout(600),
]

BLOCK_SIZE = 32
PROMPT = list(range(1000, 1070))
"""70 tokens: two full blocks and a partial one."""
OTHER = list(range(2000, 2070))
MAX_TOKENS = 4


def pinned(request_id: str, token_ids: list[int], dp_rank: int) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        token_ids=token_ids,
        max_tokens=MAX_TOKENS,
        sampling=SamplingParams(temperature=0.0),
        dp_rank=dp_rank,
    )


async def run(engine: VllmEngine, request: GenerateRequest) -> tuple[list[int], int]:
    """The request's tokens and cached prompt tokens."""
    chunks = [chunk async for chunk in engine.generate(request)]
    return [t for chunk in chunks for t in chunk.token_ids], chunks[0].num_cached_tokens or 0


def stored_by_rank(batches: list[KvEventBatch]) -> dict[int, set[int]]:
    """Rank -> the block hashes its KV events stored."""
    found: dict[int, set[int]] = {}
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                found.setdefault(batch.dp_rank, set()).update(block.block_hash for block in event.blocks)
    return found


async def until_stored(batches: list[KvEventBatch], rank: int, hashes: set[int]) -> None:
    async with asyncio.timeout(10):
        while not hashes <= stored_by_rank(batches).get(rank, set()):
            await asyncio.sleep(0.05)


async def test_a_vllm_engine_of_two_ranks_pins_requests_and_stamps_each_ranks_kv_events(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # rank 0 on core 0, rank 1 on core 1
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    extra = {**VLLM_TEST_EXTRA, "data_parallel_size": 2}
    engine = VllmEngine(EngineArgs(model="smollm2", block_size=BLOCK_SIZE, context_length=1024, extra=extra))
    batches: list[KvEventBatch] = []

    async def read_events() -> None:
        async for batch in engine.kv_events():
            batches.append(batch)

    reader = None
    try:
        info = await engine.start()
        assert (info.extra["dp_start"], info.extra["dp_size"]) == (0, 2)
        reader = asyncio.ensure_future(read_events())
        prompt_blocks = set(sequence_hashes(PROMPT, BLOCK_SIZE)[:2])
        other_blocks = set(sequence_hashes(OTHER, BLOCK_SIZE)[:2])

        on_rank_1, cached = await run(engine, pinned("p1", PROMPT, 1))
        assert len(on_rank_1) == MAX_TOKENS and cached == 0
        await until_stored(batches, 1, prompt_blocks)
        assert not prompt_blocks & stored_by_rank(batches).get(0, set())  # it ran on rank 1 only

        _, cached = await run(engine, pinned("o0", OTHER, 0))  # rank 0 serves too
        assert cached == 0
        await until_stored(batches, 0, other_blocks)

        again, cached = await run(engine, pinned("p1-again", PROMPT, 1))
        assert (again, cached) == (on_rank_1, 2 * BLOCK_SIZE)  # the prefix is rank 1's
        on_rank_0, cached = await run(engine, pinned("p0", PROMPT, 0))
        assert (on_rank_0, cached) == (on_rank_1, 0)  # rank 0 never held it: the same model, a cache of its own

        await until_stored(batches, 0, prompt_blocks)
        assert [batch.event_id for batch in batches] == list(range(len(batches)))  # one numbering for both ranks
        load = engine.load_metrics()
        assert [rank.dp_rank for rank in load.ranks] == [0, 1]
        assert all(rank.total_blocks == info.total_kv_blocks // 2 > 0 for rank in load.ranks)
    finally:
        await engine.stop()
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
