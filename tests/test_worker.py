"""The worker's endpoints over the real request plane: what an engine refuses is not migrated.

A request the engine refuses (RequestError: here a token id outside the vocabulary) reaches the caller as
a RemoteError with the engine's 400 and `is_migratable` False, so the frontend never retries it on another
worker (where it would be refused, or worse, again). A side endpoint's body that is not its wire struct is
refused the same way, never as a handler crash.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from dyn_engines.mocker.engine import MockerEngine

from dynamo_cli.config import WorkerConfig
from dynamo_cli.engine import EngineArgs
from dynamo_cli.errors import RemoteError
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
