"""The worker's `generate` endpoint over the real request plane: what an engine refuses is not migrated.

A request the engine refuses (RequestError: here a token id outside the vocabulary) reaches the caller as
a RemoteError with the engine's 400 and `is_migratable` False, so the frontend never retries it on another
worker (where it would be refused, or worse, again).
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
from dyn_engines.mocker.engine import MockerEngine

from dynamo_cli.config import WorkerConfig
from dynamo_cli.engine import EngineArgs, GenerateRequest
from dynamo_cli.errors import RemoteError
from dynamo_cli.runtime.transport import RequestClient, RequestServer
from dynamo_cli.worker import Worker


@pytest.mark.parametrize("bad", [32000, 2**32, 2**63], ids=["vocab-size", "2^32", "2^63"])
async def test_a_request_the_engine_refuses_fails_as_not_migratable(tmp_path: Path, bad: int) -> None:
    engine = MockerEngine(EngineArgs(model=str(tmp_path), extra={"speedup_ratio": 1e6, "vocab_size": 32000}))
    await engine.start()
    config = WorkerConfig(engine="mocker", model=str(tmp_path))
    worker = Worker(config, engine, None, None)  # type: ignore[arg-type]  # generate() uses neither plane
    server = RequestServer()
    server.add_endpoint("generate", worker.generate)
    client = RequestClient(await server.start())
    try:
        body = msgspec.msgpack.encode(
            GenerateRequest(request_id=f"w-{time.monotonic_ns()}", token_ids=[5, bad, 7], max_tokens=4)
        )
        stream = await client.open_stream("generate", body)
        with pytest.raises(RemoteError, match="outside this model's vocabulary") as refused:
            [item async for item in stream]
        assert refused.value.status == 400 and not refused.value.is_migratable
    finally:
        await client.close()
        await server.close()
        await engine.stop()
