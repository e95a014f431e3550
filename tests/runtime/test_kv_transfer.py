"""The KV transfer plane's contract on real sockets, once per backend (TCP, and NIXL where it imports).

Each pull must return exactly the offered bytes once; everything else (a second pull, an unknown id, a
stranger, a stalled server, an expired or released payload) fails cleanly and leaves nothing held.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest

from dynamo_cli.errors import KvTransferFull, TransferFailed
from dynamo_cli.runtime import kv_transfer
from dynamo_cli.runtime.kv_transfer import KvTransferClient, KvTransferServer
from dynamo_cli.runtime.kv_transfer_nixl import load_agent_class

SECRET = bytes(range(32))
WRONG = bytes(range(1, 33))
MiB = 1 << 20
HAS_NIXL = load_agent_class() is not None

BACKENDS = [
    pytest.param("tcp", id="tcp"),
    pytest.param(
        "nixl",
        id="nixl",
        marks=pytest.mark.skipif(not HAS_NIXL, reason="nixl does not import (pip install 'dynamo-cli[nixl]')"),
    ),
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "nixl":  # UCX over loopback TCP only, read when an agent is made
        monkeypatch.setenv("UCX_TLS", "tcp,self")
        monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    return str(request.param)


async def started(backend: str, **options: object) -> tuple[KvTransferServer, str]:
    server = KvTransferServer("127.0.0.1", secret=SECRET, use_nixl=backend == "nixl", **options)  # type: ignore[arg-type]
    return server, await server.start()


@pytest.fixture
async def plane(backend: str) -> AsyncIterator[tuple[KvTransferServer, str, KvTransferClient]]:
    server, address = await started(backend)
    client = KvTransferClient(secret=SECRET, timeout_s=10.0)
    yield server, address, client
    await client.close()
    await server.close()


async def until_freed(server: KvTransferServer) -> tuple[int, int]:
    """held() once the server noticed a puller that left after claiming (it frees when the connection ends)."""
    async with asyncio.timeout(5):
        while server.held() != (0, 0):
            await asyncio.sleep(0.01)
    return server.held()


def expected_backend(backend: str, nbytes: int) -> str:
    return "nixl" if backend == "nixl" and nbytes else "tcp"  # an empty payload is never registered


@pytest.mark.parametrize("nbytes", [0, 1, MiB, 64 * MiB], ids=["0B", "1B", "1MiB", "64MiB"])
async def test_a_pull_returns_exactly_the_offered_bytes_and_frees_them(plane, backend: str, nbytes: int) -> None:  # type: ignore[no-untyped-def]
    server, address, client = plane
    payload = os.urandom(nbytes)
    offer = server.offer(payload)
    assert len(offer.transfer_id) == 32 and offer.nbytes == nbytes
    assert (offer.nixl is not None) == (expected_backend(backend, nbytes) == "nixl")
    assert server.held() == (1, nbytes)
    pulled = await client.pull(address, offer.transfer_id, nbytes, offer.nixl)
    assert pulled.payload == payload
    assert pulled.backend == expected_backend(backend, nbytes)
    assert pulled.seconds > 0
    assert server.held() == (0, 0)
    stats = server.stats
    assert (stats.num_offered, stats.num_pulled, stats.num_failed) == (1, 1, 0)
    assert stats.bytes_served == (nbytes if pulled.backend == "tcp" else 0)


async def test_a_second_pull_of_the_same_id_fails_cleanly(plane) -> None:  # type: ignore[no-untyped-def]
    server, address, client = plane
    offer = server.offer(b"kv" * 1000)
    await client.pull(address, offer.transfer_id, offer.nbytes, offer.nixl)
    with pytest.raises(TransferFailed, match="no such payload"):
        await client.pull(address, offer.transfer_id, offer.nbytes, offer.nixl)
    assert server.held() == (0, 0)


async def test_an_unknown_or_malformed_id_fails_cleanly(plane) -> None:  # type: ignore[no-untyped-def]
    server, address, client = plane
    offer = server.offer(b"x" * 100)
    with pytest.raises(TransferFailed, match="no such payload"):
        await client.pull(address, "ab" * 16, 100)
    with pytest.raises(TransferFailed, match="32 hex digits"):
        await client.pull(address, "ab" * 8, 100)
    with pytest.raises(TransferFailed, match="not the 99 expected"):
        await client.pull(address, offer.transfer_id, 99, offer.nixl)
    assert await until_freed(server) == (0, 0)  # the size mismatch was still its one pull
    assert server.stats.num_failed + server.stats.num_pulled == 1  # TCP: sent in full; the client said no


async def test_a_wrong_secret_is_refused_and_the_payload_stays_for_the_right_puller(plane) -> None:  # type: ignore[no-untyped-def]
    server, address, client = plane
    payload = os.urandom(MiB)
    offer = server.offer(payload)
    for stranger in (KvTransferClient(secret=WRONG, timeout_s=2.0), KvTransferClient(secret=None, timeout_s=2.0)):
        with pytest.raises(TransferFailed):
            await stranger.pull(address, offer.transfer_id, offer.nbytes)
    reader, writer = await asyncio.open_connection(*address.rsplit(":", 1))
    writer.write(os.urandom(4096))  # garbage instead of the handshake's answer
    assert len(await asyncio.wait_for(reader.read(), 5)) <= 46  # the hello, then the door closes
    writer.close()
    assert server.held() == (1, MiB) and server.stats.num_refused == 3
    assert (await client.pull(address, offer.transfer_id, offer.nbytes, offer.nixl)).payload == payload


async def test_a_server_without_a_secret_refuses_to_listen_beyond_loopback() -> None:
    from dynamo_cli.errors import ConfigError

    with pytest.raises(ConfigError, match="KV transfer plane"):
        await KvTransferServer("0.0.0.0", secret=None).start()


@pytest.mark.skipif(not HAS_NIXL, reason="nixl does not import (pip install 'dynamo-cli[nixl]')")
async def test_a_nixl_read_that_fails_is_a_clean_transfer_failure_and_frees_the_payload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import msgspec

    from dynamo_cli.runtime.kv_transfer_nixl import NixlOffer

    monkeypatch.setenv("UCX_TLS", "tcp,self")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    server, address = await started("nixl")
    client = KvTransferClient(secret=SECRET, timeout_s=10.0)
    try:
        offer = server.offer(b"k" * 4096)
        assert offer.nixl is not None
        real = msgspec.msgpack.decode(offer.nixl, type=NixlOffer)
        forged = msgspec.msgpack.encode(msgspec.structs.replace(real, metadata=b"not nixl metadata"))
        with pytest.raises(TransferFailed, match="NIXL failed"):
            await client.pull(address, offer.transfer_id, offer.nbytes, forged)
        assert await until_freed(server) == (0, 0) and server.stats.num_failed == 1
    finally:
        await client.close()
        await server.close()


async def test_an_unpulled_payload_expires_after_its_ttl(backend: str) -> None:
    server, address = await started(backend, ttl_s=0.2)
    try:
        offer = server.offer(b"y" * 4096)
        await asyncio.sleep(0.6)
        assert server.held() == (0, 0) and server.stats.num_expired == 1
        with pytest.raises(TransferFailed, match="no such payload"):
            await KvTransferClient(secret=SECRET).pull(address, offer.transfer_id, offer.nbytes, offer.nixl)
    finally:
        await server.close()


async def test_release_frees_a_payload_nobody_will_pull(plane) -> None:  # type: ignore[no-untyped-def]
    server, address, client = plane
    offer = server.offer(b"z" * 4096)
    assert server.release(offer.transfer_id) is True
    assert server.held() == (0, 0)
    assert server.release(offer.transfer_id) is False
    with pytest.raises(TransferFailed, match="no such payload"):
        await client.pull(address, offer.transfer_id, offer.nbytes, offer.nixl)
    assert server.stats.num_released == 1


async def test_an_offer_over_the_byte_budget_is_refused(backend: str) -> None:
    server, _ = await started(backend, max_bytes=100)
    try:
        server.offer(b"a" * 60)
        with pytest.raises(KvTransferFull, match="holds 60 bytes"):
            server.offer(b"b" * 41)
        assert server.held() == (1, 60)
        server.offer(b"c" * 40)  # exactly at the budget
        assert server.held() == (2, 100)
    finally:
        await server.close()
    assert server.held() == (0, 0)


async def test_eight_concurrent_pulls_each_get_their_own_bytes(plane) -> None:  # type: ignore[no-untyped-def]
    server, address, client = plane
    payloads = [os.urandom(2 * MiB + i) for i in range(8)]
    offers = [server.offer(p) for p in payloads]
    pulled = await asyncio.gather(*(client.pull(address, o.transfer_id, o.nbytes, o.nixl) for o in offers))
    assert [p.payload for p in pulled] == payloads
    assert server.held() == (0, 0) and server.stats.num_pulled == 8


async def test_a_server_that_stalls_mid_payload_times_the_client_out() -> None:
    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(17)
        writer.write(kv_transfer._HEADER.pack(kv_transfer.STATUS_OK, MiB) + b"\0" * 1000)
        await asyncio.sleep(30)

    server = await asyncio.start_server(stall, "127.0.0.1", 0)
    address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with asyncio.timeout(5):
            with pytest.raises(TransferFailed, match="no progress within 0.3 s"):
                await KvTransferClient(secret=None, timeout_s=0.3).pull(address, "ab" * 16, MiB)
    finally:
        server.close()


async def read_all(reader: asyncio.StreamReader) -> bytes:
    try:
        return await asyncio.wait_for(reader.read(), 3)
    except ConnectionResetError:
        return b""


async def test_idle_connections_and_a_flood_are_cut_off_without_harming_a_pull(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_transfer, "REQUEST_TIMEOUT_S", 0.5)
    monkeypatch.setattr(kv_transfer, "MAX_CONNECTIONS", 4)
    server, address = await started("tcp")
    host, port = address.rsplit(":", 1)
    client = KvTransferClient(secret=SECRET)
    try:
        idle = [await asyncio.open_connection(host, port) for _ in range(3)]  # slowloris: never answer
        payload = os.urandom(MiB)
        offer = server.offer(payload)
        assert (await client.pull(address, offer.transfer_id, MiB)).payload == payload  # the 4th slot
        idle.append(await asyncio.open_connection(host, port))
        flood, _ = await asyncio.open_connection(host, port)  # a 5th: closed at once, not even a hello
        assert await read_all(flood) == b""
        for reader, _ in idle:  # each got the hello, then was cut off at the request deadline
            assert len(await read_all(reader)) == 46
        offer = server.offer(payload)
        assert (await client.pull(address, offer.transfer_id, MiB)).payload == payload
        assert server.stats.num_refused == 5 and server.held() == (0, 0)
    finally:
        await server.close()
