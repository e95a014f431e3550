"""The TCP request plane: multiplexing, cancellation, failures, bad peers (authentication: test_transport_auth)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from dynamo_cli.errors import Overloaded, RemoteError, RequestError, WorkerDisconnected
from dynamo_cli.runtime.framing import FrameCodec, FrameError
from dynamo_cli.runtime.request_client import RequestClient
from dynamo_cli.runtime.transport import RequestServer
from tests.request_plane import raw

enc = msgspec.msgpack.encode


class Endpoints:
    def __init__(self) -> None:
        self.aborted: list[int] = []

    async def count(self, body: msgspec.Raw):  # type: ignore[no-untyped-def]
        for i in range(msgspec.msgpack.decode(body)):
            yield enc(i)
            await asyncio.sleep(0)

    async def forever(self, body: msgspec.Raw):  # type: ignore[no-untyped-def]
        tag = msgspec.msgpack.decode(body)
        try:
            while True:
                yield enc(tag)
                await asyncio.sleep(0.005)
        finally:
            self.aborted.append(tag)

    async def bad(self, body: msgspec.Raw):  # type: ignore[no-untyped-def]
        yield enc(0)
        raise RequestError("max_tokens is too large", param="max_tokens")

    async def busy(self, body: msgspec.Raw):  # type: ignore[no-untyped-def]
        yield enc(0)
        raise Overloaded("every worker is busy", retry_after=2.5)

    async def lost(self, body: msgspec.Raw):  # type: ignore[no-untyped-def]
        yield enc(0)
        raise WorkerDisconnected("the backend behind this proxy went away")


@pytest.fixture(params=[None, bytes(range(32))], ids=["open", "authenticated"])
async def served(request):  # type: ignore[no-untyped-def]
    """Every test runs both without a cluster secret (loopback) and with one on both sides."""
    endpoints = Endpoints()
    server = RequestServer(secret=request.param)
    for name in ("count", "forever", "bad", "busy", "lost"):
        server.add_endpoint(raw(name), getattr(endpoints, name))
    address = await server.start()
    client = RequestClient(address, secret=request.param)
    yield endpoints, server, client
    await client.close()
    await server.close()


async def collect(client: RequestClient, endpoint: str, arg: int) -> list[int]:
    stream = await client.open_stream(endpoint, enc(arg))
    return [msgspec.msgpack.decode(item) async for item in stream]


async def test_many_streams_share_one_connection_and_each_gets_its_own_items(served) -> None:  # type: ignore[no-untyped-def]
    _, _, client = served
    results = await asyncio.gather(*(collect(client, "count", n) for n in range(50)))
    assert results == [list(range(n)) for n in range(50)]


async def test_cancelling_a_stream_aborts_the_handler_on_the_server(served) -> None:  # type: ignore[no-untyped-def]
    endpoints, server, client = served
    stream = await client.open_stream("forever", enc(7))
    assert await stream.next_batch()
    stream.cancel()
    for _ in range(100):
        if endpoints.aborted:
            break
        await asyncio.sleep(0.01)
    assert endpoints.aborted == [7]
    assert server.num_inflight == 0


async def test_a_handler_error_reaches_the_caller_with_its_message(served) -> None:  # type: ignore[no-untyped-def]
    _, _, client = served
    with pytest.raises(RemoteError, match="max_tokens is too large") as info:
        await collect(client, "bad", 0)
    assert info.value.status == 400 and info.value.is_client_error
    assert info.value.as_request_error("max_tokens").param == "max_tokens"


async def test_an_error_crosses_the_plane_with_its_class_status_retry_hint_and_migratability(served) -> None:  # type: ignore[no-untyped-def]
    _, _, client = served
    with pytest.raises(RemoteError, match="every worker is busy") as busy:
        await collect(client, "busy", 0)
    assert (busy.value.status, busy.value.retry_after, busy.value.is_client_error) == (503, 2.5, False)
    with pytest.raises(WorkerDisconnected, match="went away") as lost:  # a proxy's lost backend: migratable
        await collect(client, "lost", 0)
    assert lost.value.is_migratable


async def test_an_unknown_endpoint_fails_as_migratable(served) -> None:  # type: ignore[no-untyped-def]
    _, _, client = served
    with pytest.raises(WorkerDisconnected, match="no endpoint 'nope'"):
        await collect(client, "nope", 0)


async def test_a_server_that_goes_away_fails_open_streams_as_disconnected(served) -> None:  # type: ignore[no-untyped-def]
    _, server, client = served
    stream = await client.open_stream("forever", enc(1))
    await stream.next_batch()
    await server.close()
    with pytest.raises(WorkerDisconnected):
        while await stream.next_batch():
            pass


async def test_connecting_to_a_closed_port_fails_fast() -> None:
    client = RequestClient("127.0.0.1:1")
    with pytest.raises(WorkerDisconnected, match="cannot connect"):
        await client.open_stream("count", enc(1))


async def test_drain_waits_for_streams_in_flight(served) -> None:  # type: ignore[no-untyped-def]
    _, server, client = served
    task = asyncio.create_task(collect(client, "count", 200))
    await asyncio.sleep(0.01)
    assert await server.drain(5.0)
    assert await task == list(range(200))


def test_a_garbage_frame_is_rejected_not_decoded() -> None:
    codec = FrameCodec()
    with pytest.raises(FrameError):
        codec.feed(b"\x00\x00\x00\x03abc")
    with pytest.raises(FrameError, match="exceeds"):
        FrameCodec().feed(b"\xff\xff\xff\xff")
