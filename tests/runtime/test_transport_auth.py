"""Request-plane authentication on real sockets: a stranger is cut off having been served nothing."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator

import msgspec
import pytest

from dynamo_cli.errors import AuthenticationFailed, ConfigError, WorkerDisconnected
from dynamo_cli.runtime import transport
from dynamo_cli.runtime.framing import Data, FrameCodec, Open
from dynamo_cli.runtime.handshake import ANSWER_BYTES, HELLO_BYTES, MAGIC, frame
from dynamo_cli.runtime.request_client import RequestClient
from dynamo_cli.runtime.transport import RequestServer
from tests.request_plane import raw

SECRET = bytes(range(32))
WRONG = bytes(range(1, 33))
enc = msgspec.msgpack.encode


class Spy:
    """Endpoints that count their calls: `generate` streams 20 tokens, `kv_dump` one secret-ish reply."""

    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, body: msgspec.Raw) -> AsyncIterator[bytes]:
        self.calls += 1
        for i in range(20):
            yield enc(i)

    async def kv_dump(self, body: msgspec.Raw) -> AsyncIterator[bytes]:
        self.calls += 1
        yield enc({"block_hashes": [1, 2, 3]})


@pytest.fixture
async def guarded():  # type: ignore[no-untyped-def]
    spy = Spy()
    server = RequestServer(secret=SECRET)
    server.add_endpoint(raw("generate"), spy.generate)
    server.add_endpoint(raw("kv_dump"), spy.kv_dump)
    address = await server.start()
    yield spy, server, address
    await server.close()


async def raw_exchange(address: str, payload: bytes, *, wait_hello: bool = False, timeout: float = 5.0) -> bytes:
    """Connect with a bare socket, send `payload`, return every byte received until the server closes."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    received = b""
    try:
        async with asyncio.timeout(timeout):
            if wait_hello:
                received = await reader.readexactly(4 + HELLO_BYTES)
            writer.write(payload)
            while chunk := await reader.read(65536):
                received += chunk
    except (ConnectionResetError, asyncio.IncompleteReadError):
        pass  # the server aborted the connection: the same as a close for what was received
    finally:
        writer.close()
    return received


def open_frame(endpoint: str, body: bytes = enc({"token_ids": [1, 2, 3], "max_tokens": 20})) -> bytes:
    return FrameCodec().encode(Open(1, endpoint, msgspec.Raw(body)))


def assert_only_the_hello(received: bytes) -> None:
    """The server sent its challenge and nothing else: no Data frame, no reply of any kind."""
    assert received == received[: 4 + HELLO_BYTES]
    if received:
        assert received[4:].startswith(MAGIC)
    assert not any(type(f) is Data for f in _frames_after_hello(received))


def _frames_after_hello(received: bytes) -> list[object]:
    rest = received[4 + HELLO_BYTES :]
    return list(FrameCodec().feed(rest)) if rest else []


@pytest.mark.parametrize("endpoint", ["generate", "kv_dump"])
@pytest.mark.parametrize("wait_hello", [False, True], ids=["at-once", "after-hello"])
async def test_a_raw_open_frame_without_the_secret_is_closed_with_nothing_served(
    guarded, endpoint: str, wait_hello: bool
) -> None:  # type: ignore[no-untyped-def]
    spy, server, address = guarded
    received = await raw_exchange(address, open_frame(endpoint), wait_hello=wait_hello)
    assert_only_the_hello(received)
    assert spy.calls == 0
    assert server.num_refused == 1


async def test_an_open_frame_the_size_of_an_answer_is_refused_too(guarded) -> None:  # type: ignore[no-untyped-def]
    spy, server, address = guarded
    body = b""
    while len(payload := open_frame("generate", enc(body))) != 4 + ANSWER_BYTES:
        body += b"x"
    received = await raw_exchange(address, payload)
    assert_only_the_hello(received)
    assert spy.calls == 0 and server.num_refused == 1


async def test_a_silent_connection_is_closed_after_the_handshake_time_limit(guarded, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(transport, "HANDSHAKE_TIMEOUT_S", 0.3)
    spy, server, address = guarded
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    async with asyncio.timeout(3):
        received = await reader.read(4 + HELLO_BYTES)
        assert await reader.read(100) == b""  # closed by the server
    writer.close()
    assert received[4:].startswith(MAGIC) and server.num_refused == 1


async def test_a_client_with_the_secret_is_served(guarded) -> None:  # type: ignore[no-untyped-def]
    spy, _, address = guarded
    client = RequestClient(address, secret=SECRET)
    try:
        tokens = [msgspec.msgpack.decode(raw) async for raw in await client.open_stream("generate", b"\x80")]
        dump = [msgspec.msgpack.decode(raw) async for raw in await client.open_stream("kv_dump", b"\x80")]
    finally:
        await client.close()
    assert tokens == list(range(20)) and dump == [{"block_hashes": [1, 2, 3]}]


async def test_a_client_with_a_wrong_secret_is_refused(guarded) -> None:  # type: ignore[no-untyped-def]
    spy, server, address = guarded
    client = RequestClient(address, secret=WRONG)
    try:
        with pytest.raises(AuthenticationFailed, match="same cluster secret") as info:
            await client.open_stream("generate", b"\x80")
    finally:
        await client.close()
    assert info.value.is_migratable  # another worker may be a genuine one
    assert spy.calls == 0 and server.num_refused == 1


async def test_a_client_without_a_secret_is_told_the_server_wants_one(guarded) -> None:  # type: ignore[no-untyped-def]
    spy, _, address = guarded
    client = RequestClient(address)
    try:
        stream = await client.open_stream("generate", b"\x80")
        with pytest.raises(WorkerDisconnected, match="cluster secret"):
            await stream.next_batch()
    finally:
        await client.close()
    assert spy.calls == 0


async def test_the_client_sends_nothing_to_a_server_that_cannot_prove_the_secret() -> None:
    received: list[bytes] = []

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(frame(MAGIC + b"n" * 32))
        received.append(await reader.readexactly(4 + ANSWER_BYTES))
        writer.write(frame(b"p" * 32))  # a made-up proof
        received.append(await reader.read())  # whatever the client sends next, until it closes
        writer.close()

    fake = await asyncio.start_server(impostor, "127.0.0.1", 0)
    port = fake.sockets[0].getsockname()[1]
    client = RequestClient(f"127.0.0.1:{port}", secret=SECRET)
    try:
        with pytest.raises(AuthenticationFailed, match="could not prove"):
            await client.open_stream("generate", enc({"prompt": "a user's secret"}))
        async with asyncio.timeout(3):
            while len(received) < 2:
                await asyncio.sleep(0.01)
    finally:
        await client.close()
        fake.close()
    assert received[1] == b""  # no Open frame: the prompt never left


async def test_the_client_gives_up_on_a_server_that_does_not_start_the_handshake(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(transport, "HANDSHAKE_TIMEOUT_S", 0.3)
    spy = Spy()
    unauthenticated = RequestServer()  # an old or misconfigured member: no secret, so no hello
    unauthenticated.add_endpoint(raw("generate"), spy.generate)
    client = RequestClient(await unauthenticated.start(), secret=SECRET)
    try:
        with pytest.raises(AuthenticationFailed, match="no handshake within"):
            await client.open_stream("generate", b"\x80")
    finally:
        await client.close()
        await unauthenticated.close()
    assert spy.calls == 0


async def test_a_flood_of_unauthenticated_connections_is_capped(guarded, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(transport, "MAX_HANDSHAKING", 1)
    spy, server, address = guarded
    host, _, port = address.rpartition(":")
    first_reader, first = await asyncio.open_connection(host, int(port))
    await first_reader.readexactly(4 + HELLO_BYTES)  # holds the only handshake slot
    received = await raw_exchange(address, b"")
    assert received == b""  # closed at once, not even challenged
    first.close()
    await asyncio.sleep(0.05)
    client = RequestClient(address, secret=SECRET)
    try:  # the slot is free again once the silent connection went away
        assert [raw async for raw in await client.open_stream("kv_dump", b"\x80")]
    finally:
        await client.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
async def test_a_server_on_the_network_without_a_secret_refuses_to_start(host: str) -> None:
    with pytest.raises(ConfigError, match="no cluster secret"):
        await RequestServer(host).start()


def test_handshake_frames_have_the_request_planes_length_prefix() -> None:
    assert struct.unpack(">I", frame(b"abc")[:4]) == (3,)
