"""The worker's endpoints over the real request plane: what an engine refuses is not migrated.

A request the engine refuses (RequestError: here a token id outside the vocabulary) reaches the caller as
a RemoteError with the engine's 400 and `is_migratable` False, so the frontend never retries it on another
worker (where it would be refused, or worse, again). A side endpoint's body that is not its wire struct is
refused the same way, never as a handler crash. A worker keeps the blocks of each data-parallel rank of its engine
apart in its `kv_dump`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from dyn_engines.mocker.engine import MockerEngine
from dyn_engines.mocker.ranks import mocker_engine

from dynamo_cli.config import WorkerConfig
from dynamo_cli.engine import EngineArgs
from dynamo_cli.errors import RemoteError
from dynamo_cli.kv.events import KvEventBatch
from dynamo_cli.kv.hashing import sequence_hashes
from dynamo_cli.runtime.request_client import RequestClient
from dynamo_cli.runtime.transport import RequestServer
from dynamo_cli.wire import GENERATE, KV_DUMP, KV_EVENTS_SINCE, KV_RELEASE, GenerateRequest, KvDumpQuery
from dynamo_cli.worker import WorkerService


@pytest.mark.parametrize("bad", [32000, 2**32, 2**63], ids=["vocab-size", "2^32", "2^63"])
async def test_a_request_the_engine_refuses_fails_as_not_migratable(tmp_path: Path, bad: int) -> None:
    engine = MockerEngine(EngineArgs(model=str(tmp_path), extra={"speedup_ratio": 1e6, "vocab_size": 32000}))
    await engine.start()
    config = WorkerConfig(engine="mocker", model=str(tmp_path))
    worker = WorkerService(config, engine, None, None)  # type: ignore[arg-type]  # generate() uses neither plane
    server = RequestServer()
    server.add_endpoint(GENERATE, worker.generate)
    client = RequestClient(await server.start())
    try:
        request = GenerateRequest(request_id=f"w-{time.monotonic_ns()}", token_ids=[5, bad, 7], max_tokens=4)
        stream = await client.open(GENERATE, request)
        with pytest.raises(RemoteError, match="outside this model's vocabulary") as refused:
            [item async for item in stream]
        assert refused.value.status == 400 and not refused.value.is_migratable
    finally:
        await client.close()
        await server.close()
        await engine.stop()


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        pytest.param(KV_EVENTS_SINCE.name, msgspec.msgpack.encode(3), id="kv_events_since-bare-int"),
        pytest.param(
            KV_EVENTS_SINCE.name, msgspec.msgpack.encode({"first_event_id": "3"}), id="kv_events_since-string-id"
        ),
        pytest.param(KV_DUMP.name, b"\x00", id="kv_dump-bare-int"),
        pytest.param(KV_RELEASE.name, msgspec.msgpack.encode("t-1"), id="kv_release-bare-string"),
        pytest.param(KV_RELEASE.name, msgspec.msgpack.encode({}), id="kv_release-no-transfer-id"),
    ],
)
async def test_a_malformed_side_endpoint_body_is_refused_as_a_request_error(endpoint: str, body: bytes) -> None:
    config = WorkerConfig(engine="mocker", model="m")
    worker = WorkerService(config, None, SimpleNamespace(lease_id=0x9), None)  # type: ignore[arg-type]  # side endpoints only
    server = RequestServer()
    server.add_endpoint(KV_EVENTS_SINCE, worker.kv_events_since)
    server.add_endpoint(KV_DUMP, worker.kv_dump)
    server.add_endpoint(KV_RELEASE, worker.kv_release)
    client = RequestClient(await server.start())
    try:
        with pytest.raises(RemoteError, match=f"malformed {endpoint} request") as refused:
            [item async for item in await client.open_stream(endpoint, body)]
        assert refused.value.status == 400 and not refused.value.is_migratable
        dump = await client.call(KV_DUMP, KvDumpQuery())
        assert dump.worker_id == 0x9  # the worker still serves
    finally:
        await client.close()
        await server.close()


class Bus:
    """The event plane at its narrowest seam: what the worker publishes, kept."""

    def __init__(self) -> None:
        self.published: list[bytes] = []

    async def publish(self, subject: str, payload: bytes) -> None:
        self.published.append(payload)


@pytest.mark.parametrize(
    ("extra", "ranks"),
    [
        pytest.param({}, [0], id="rank-blind"),
        pytest.param({"data_parallel_size": 3, "data_parallel_start_rank": 2}, [2, 3, 4], id="ranks-2-to-4"),
    ],
)
async def test_a_workers_kv_dump_and_load_keep_each_ranks_blocks_apart(
    tmp_path: Path, extra: dict[str, int], ranks: list[int]
) -> None:
    """Through the real mocker: each rank's prompt lands in that rank's lists of the dump, one event numbering."""
    args = EngineArgs(model=str(tmp_path), block_size=16, extra={"speedup_ratio": 1e6, **extra})
    engine = mocker_engine(args)
    bus = Bus()
    worker = WorkerService(
        WorkerConfig(engine="mocker", model=str(tmp_path)), engine, SimpleNamespace(lease_id=0x9), bus
    )  # type: ignore[arg-type]
    card = await worker.start_engine()
    pump = asyncio.get_running_loop().create_task(worker.pump_kv_events())
    prompts = {rank: list(range(100 * i + 1, 100 * i + 41)) for i, rank in enumerate(ranks)}  # 2 full blocks each
    for rank, prompt in prompts.items():
        pinned = rank if card.is_ranked else None
        request = GenerateRequest(request_id=f"r{rank}", token_ids=prompt, max_tokens=2, dp_rank=pinned)
        chunks = [chunk async for chunk in worker.generate(request)]
        assert chunks[-1].finish_reason == "length"
    load = worker.load_now()
    await engine.stop()
    await asyncio.wait_for(pump, 1.0)
    dump = [item async for item in worker.kv_dump(KvDumpQuery())][0]
    per_rank = {dump.dp_rank: dump.block_hashes, **{other.dp_rank: other.block_hashes for other in dump.ranks}}
    assert per_rank == {rank: sorted(sequence_hashes(prompt, 16)) for rank, prompt in prompts.items()}
    assert (dump.worker_id, dump.last_event_id, dump.dp_rank) == (0x9, len(bus.published) - 1, ranks[0])
    published = [msgspec.msgpack.decode(payload, type=KvEventBatch) for payload in bus.published]
    assert [batch.event_id for batch in published] == list(range(len(published)))
    assert {batch.worker_id for batch in published} == {0x9}
    assert [rank.dp_rank for rank in load.ranks] == (ranks if card.is_ranked else [])
    assert load.worker_id == 0x9
