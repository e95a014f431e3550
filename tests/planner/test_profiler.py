"""`dyn plan profile` of a ranked engine: the profile is one rank's, every sweep request pinned to it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from dynamo_cli.engine import Engine, EngineArgs, EngineInfo, load_engine
from dynamo_cli.kv.events import KvEventBatch
from dynamo_cli.planner.profiler import Sweep, profile_engine
from dynamo_cli.wire import GenerateChunk, GenerateRequest

BLOCKS = 256  # per rank
SWEEP = Sweep(isls=(256,), contexts=(1024,), usages=(0.5,), decode_tokens=4, repeats=1, timeout_s=60.0)


class Recording:
    """An engine that notes the rank each request names."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ranks: list[int | None] = []

    async def start(self) -> EngineInfo:
        return await self.engine.start()

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self.ranks.append(request.dp_rank)
        return self.engine.generate(request)

    def kv_events(self) -> AsyncIterator[KvEventBatch]:
        return self.engine.kv_events()

    async def stop(self) -> None:
        await self.engine.stop()


@pytest.mark.parametrize(
    ("ranks", "pinned"),
    [
        pytest.param({}, None, id="a rank-blind mocker"),
        pytest.param({"data_parallel_size": 2, "data_parallel_start_rank": 2}, 2, id="ranks 2-3: its first"),
    ],
)
async def test_a_ranked_engine_is_profiled_as_its_first_rank(ranks: dict[str, int], pinned: int | None) -> None:
    # a ranked mocker reports its ranks' sums (2 × 256 blocks, 2 × 256 seqs); the profile holds one rank's, and
    # the decode sweep's n = 0.5 × (256 blocks' tokens) / 1024 requests share that rank's cache
    extra = {"num_gpu_blocks": BLOCKS, "speedup_ratio": 10.0, **ranks}
    engine = Recording(load_engine("mocker")(EngineArgs(model="smollm2", extra=extra)))
    info = await engine.start()
    try:
        profile = await profile_engine(
            engine, info, engine_name="mocker", model="smollm2", speedup_ratio=10.0, sweep=SWEEP
        )
    finally:
        await engine.stop()
    assert info.total_kv_blocks == BLOCKS * (2 if ranks else 1)
    assert (profile.max_kv_tokens, profile.max_num_seqs) == (BLOCKS * info.block_size, 256)
    n = round(0.5 * BLOCKS * info.block_size / 1024)
    assert [s.concurrency for s in profile.decode] == [n]
    assert engine.ranks == [pinned] * (1 + n)  # one prefill request, n decode requests
