"""The endpoint layer on every Discovery backend: serving registers, a Client sees it, stopping drains."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

import tests.planes
from dynamo_cli.errors import NoWorkers
from dynamo_cli.runtime.discovery import Discovery
from dynamo_cli.runtime.endpoint import Connections, Endpoint, Instance, InstanceWatch
from dynamo_cli.runtime.names import EndpointName
from dynamo_cli.runtime.planes import open_discovery
from dynamo_cli.runtime.request_client import ResponseStream
from dynamo_cli.runtime.supervisor import ServiceTasks
from dynamo_cli.runtime.transport import RequestServer
from tests.request_plane import raw

etcd_process = tests.planes.etcd_process
etcd_server = tests.planes.etcd_server

NAME = EndpointName("test", "backend", "generate")
OTHER = EndpointName("test", "backend", "other")
WAIT_S = 5.0


class Card(msgspec.Struct, frozen=True, kw_only=True):
    """What the test endpoint serves (the runtime does not read it)."""

    label: str


@pytest.fixture(
    params=[pytest.param("embedded", id="embedded"), pytest.param("etcd", id="etcd", marks=pytest.mark.etcd)]
)
def discovery_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "embedded":
        return f"file://{tmp_path / 'discovery'}"
    return str(request.getfixturevalue("etcd_server"))


@pytest.fixture
async def planes(discovery_url: str) -> AsyncIterator[tuple[Discovery, Discovery]]:
    """Two processes' discovery on one store: a server's and a client's."""
    opened = [open_discovery(discovery_url, ttl=2.0) for _ in range(2)]
    for discovery in opened:
        async with asyncio.timeout(WAIT_S):
            await discovery.start()
    yield opened[0], opened[1]
    for discovery in opened:
        await discovery.close()


async def echo(body: msgspec.Raw) -> AsyncIterator[bytes]:
    yield bytes(body)


class Client:
    """The client side as production composes it: a watch of NAME's instances and a connection per address."""

    def __init__(self, discovery: Discovery) -> None:
        self.watch = InstanceWatch(discovery, f"{NAME.path}/", Card, accept=lambda name: name == NAME)
        self.connections = Connections()

    def instances(self) -> list[Instance[Card]]:
        return [self.watch.instances[i] for i in sorted(self.watch.instances)]

    async def open_stream(self, body: bytes) -> tuple[Instance[Card], ResponseStream]:
        instances = self.instances()
        if not instances:
            raise NoWorkers(f"endpoint '{NAME}'")
        client = self.connections.get(instances[0].record.address)
        return instances[0], await client.open_stream(NAME.endpoint, body)


async def wait_for(client: Client, count: int) -> None:
    async with asyncio.timeout(WAIT_S):
        while len(client.instances()) != count:
            client.watch.changed.clear()
            await client.watch.changed.wait()


@contextlib.asynccontextmanager
async def server_and_client(client_side: Discovery) -> AsyncIterator[tuple[RequestServer, Client]]:
    """A started request server, and a running Client of NAME on another process's discovery."""
    server = RequestServer()
    await server.start()
    client = Client(client_side)
    try:
        async with ServiceTasks() as tasks:
            for loop in client.watch.loops():
                tasks.spawn(loop)
            yield server, client
    finally:
        await client.connections.close()
        await server.close()


async def test_a_served_endpoint_is_visible_to_a_client_with_its_card_until_it_stops(
    planes: tuple[Discovery, Discovery],
) -> None:
    server_side, client_side = planes
    async with server_and_client(client_side) as (server, client):
        async with Endpoint(NAME, server_side).serve_endpoint(
            server, raw(NAME.endpoint), echo, Card(label="a"), role="both", grace_s=1
        ):
            await wait_for(client, 1)
            [instance] = client.instances()
            assert (instance.instance_id, instance.card, instance.record.address) == (
                server_side.lease_id,
                Card(label="a"),
                server.address,
            )
            _, stream = await client.open_stream(msgspec.msgpack.encode("hello"))
            assert [msgspec.msgpack.decode(raw) async for raw in stream] == ["hello"]
        await wait_for(client, 0)
        with pytest.raises(NoWorkers):
            await client.open_stream(msgspec.msgpack.encode("nobody"))


async def test_stopping_deregisters_first_then_drains_the_streams_in_flight(
    planes: tuple[Discovery, Discovery],
) -> None:
    server_side, client_side = planes
    release, started = asyncio.Event(), asyncio.Event()

    async def slow(body: msgspec.Raw) -> AsyncIterator[bytes]:
        started.set()
        await release.wait()
        yield msgspec.msgpack.encode("done")

    async with server_and_client(client_side) as (server, client):
        endpoint = Endpoint(NAME, server_side)
        serving = endpoint.serve_endpoint(
            server, raw(NAME.endpoint), slow, Card(label="a"), role="both", grace_s=WAIT_S
        )
        await serving.__aenter__()
        await wait_for(client, 1)
        _, stream = await client.open_stream(msgspec.msgpack.encode(None))
        await asyncio.wait_for(started.wait(), WAIT_S)
        stopping = asyncio.create_task(serving.__aexit__(None, None, None))
        await wait_for(client, 0)  # deregistered while the stream is still in flight
        assert not stopping.done() and server.num_inflight == 1
        release.set()
        assert [msgspec.msgpack.decode(raw) async for raw in stream] == ["done"]
        await asyncio.wait_for(stopping, WAIT_S)  # the drain ends with the stream
        assert server.num_inflight == 0


async def test_a_watch_counts_an_instance_only_while_both_its_record_and_card_are_known(
    planes: tuple[Discovery, Discovery],
) -> None:
    server_side, client_side = planes
    watch = InstanceWatch(client_side, "test/", Card, accept=lambda name: name == NAME)
    joined: list[int] = []
    left: list[int] = []
    watch.on_join = lambda instance: joined.append(instance.instance_id)
    watch.on_leave = lambda instance: left.append(instance.instance_id)
    lease = server_side.lease_id
    async with ServiceTasks() as tasks:
        for loop in watch.loops():
            tasks.spawn(loop)
        await server_side.put(OTHER.card_key(lease), msgspec.json.encode(Card(label="other")))
        await server_side.put(NAME.card_key(lease), msgspec.json.encode(Card(label="a")))
        await asyncio.sleep(0.5)
        assert (watch.instances, joined) == ({}, [])  # a card alone is not an instance
        server = RequestServer()
        await server.start()
        async with Endpoint(NAME, server_side).serve_endpoint(
            server, raw(NAME.endpoint), echo, Card(label="a"), role="both", grace_s=1
        ):
            async with asyncio.timeout(WAIT_S):
                while not joined:
                    await asyncio.sleep(0.05)
        async with asyncio.timeout(WAIT_S):
            while not left:
                await asyncio.sleep(0.05)
        await server.close()
    assert (joined, left, watch.instances) == ([lease], [lease], {})
