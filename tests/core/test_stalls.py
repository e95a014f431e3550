"""The stream deadline: a worker that sends nothing at all for the stall timeout is hung (its stream fails over,
the worker leaves routing); one that still reports its load is only slow. On the real request plane."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
import pytest

from dynamo_cli.config import BusyThresholds
from dynamo_cli.core.registry import Worker
from dynamo_cli.core.stalls import Deadline
from dynamo_cli.errors import WorkerHung
from dynamo_cli.model_card import ModelCard
from dynamo_cli.runtime.endpoint import InstanceRecord
from dynamo_cli.runtime.request_client import RequestClient
from dynamo_cli.runtime.transport import RequestServer
from tests.request_plane import raw

FIRST = msgspec.msgpack.encode("first")


class Counted:
    def __init__(self) -> None:
        self.stalls: list[tuple[str, int, str]] = []

    def count_stall(self, model: str, worker_id: int, reason: str) -> None:
        self.stalls.append((model, worker_id, reason))

    def count_recovery(self, model: str, worker_id: int) -> None:
        pass


async def _one_then_silence(body: msgspec.Raw) -> AsyncIterator[bytes]:
    yield FIRST
    await asyncio.Event().wait()  # hung: alive, connected, producing nothing


async def _open(server: RequestServer) -> tuple[Worker, RequestClient]:
    address = await server.start()
    client = RequestClient(address)
    record = InstanceRecord(
        namespace="ns", component="backend", endpoint="generate", instance_id=7, transport={"tcp": address}
    )
    card = ModelCard(display_name="m", tokenizer_source="-", engine="mocker")
    return Worker(7, record, card, client), client


async def test_a_silent_worker_is_hung_after_the_stall_timeout_and_leaves_routing() -> None:
    server = RequestServer()
    server.add_endpoint(raw("generate"), _one_then_silence)
    worker, client = await _open(server)
    metrics = Counted()
    try:
        stream = await client.open_stream("generate", msgspec.msgpack.encode({}))
        deadline = Deadline(0.3, metrics)
        assert [bytes(raw) for raw in await deadline.next_batch(stream, worker, "m")] == [FIRST]
        started = time.monotonic()
        with pytest.raises(WorkerHung):
            await deadline.next_batch(stream, worker, "m")
        assert 0.25 <= time.monotonic() - started < 2.0
        assert worker.hung is not None and metrics.stalls == [("m", 7, "deadline")]
        assert "not answering" in (worker.busy_reason(BusyThresholds()) or "")  # routing skips it
    finally:
        await client.close()
        await server.close()


async def test_a_worker_that_still_reports_its_load_is_slow_not_hung() -> None:
    server = RequestServer()
    server.add_endpoint(raw("generate"), _one_then_silence)
    worker, client = await _open(server)
    metrics = Counted()

    async def reports(until: float) -> None:
        while time.monotonic() < until:
            worker.heard_at = time.monotonic()  # what a load report does (Registry.apply_load)
            await asyncio.sleep(0.05)

    try:
        stream = await client.open_stream("generate", msgspec.msgpack.encode({}))
        deadline = Deadline(0.3, metrics)
        await deadline.next_batch(stream, worker, "m")
        started = time.monotonic()
        reporter = asyncio.create_task(reports(started + 1.0))
        with pytest.raises(WorkerHung):
            await deadline.next_batch(stream, worker, "m")
        waited = time.monotonic() - started
        assert 1.2 <= waited < 3.0, waited  # the reports kept it waiting; 0.3 s after the last one it gave up
        await reporter
        assert metrics.stalls == [("m", 7, "deadline")]
    finally:
        await client.close()
        await server.close()


async def _mute_server() -> tuple[asyncio.Server, str]:
    """A listener that accepts and never speaks: what a stopped process's kernel does with a new connection."""
    server = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


def _worker_at(address: str) -> Worker:
    record = InstanceRecord(namespace="ns", component="backend", endpoint="generate", instance_id=7, transport={})
    card = ModelCard(display_name="m", tokenizer_source="-", engine="mocker")
    return Worker(7, record, card, RequestClient(address, secret=bytes(32)))


async def test_a_first_connection_to_a_silent_worker_is_hung_after_the_stall_timeout_not_the_handshakes() -> None:
    server, address = await _mute_server()
    worker, metrics = _worker_at(address), Counted()
    worker.heard_at = time.monotonic() - 5  # its load reports stopped with it
    started = time.monotonic()
    try:
        with pytest.raises(WorkerHung, match="while connecting"):
            await Deadline(0.3, metrics).open(worker, "m", raw("generate"), msgspec.Raw(b"\x80"))
        assert time.monotonic() - started < 2.0  # not the request plane's 10 s handshake wait
        assert worker.hung is not None and metrics.stalls == [("m", 7, "deadline")]
    finally:
        await worker.client.close()
        server.close()


async def test_a_connecting_worker_that_still_reports_its_load_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    import dynamo_cli.runtime.request_client as request_client

    monkeypatch.setattr(request_client, "HANDSHAKE_TIMEOUT_S", 1.0)
    server, address = await _mute_server()
    worker, metrics = _worker_at(address), Counted()

    async def reports() -> None:
        while True:
            worker.heard_at = time.monotonic()  # what a load report does (Registry.apply_load)
            await asyncio.sleep(0.05)

    reporter = asyncio.create_task(reports())
    try:
        with pytest.raises(Exception, match="no handshake within") as failed:  # the plane's own limit, not hung
            await Deadline(0.3, metrics).open(worker, "m", raw("generate"), msgspec.Raw(b"\x80"))
        assert failed.value.is_migratable and worker.hung is None and metrics.stalls == []  # type: ignore[attr-defined]
    finally:
        reporter.cancel()
        await worker.client.close()
        server.close()
