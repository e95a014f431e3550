"""One contract for every EventBus backend: the embedded one (ZMQ on this host) and NATS."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

import tests.planes
from dynamo_cli.errors import ConfigError, PlaneUnavailable
from dynamo_cli.runtime.discovery import Discovery
from dynamo_cli.runtime.events import SUBSCRIBER_QUEUE, EventBus, Subscription
from dynamo_cli.runtime.nats import NatsEventBus, parse_nats_url
from dynamo_cli.runtime.planes import open_discovery, open_event_bus

# The plane fixtures; tests/conftest.py may register tests.planes too, which is harmless.
nats_process = tests.planes.nats_process
nats_server = tests.planes.nats_server

KV_EVENTS = "namespace.test.component.backend.kv-events"
STREAM = "kv-events-test"
BusOpener = Callable[[], Awaitable[EventBus]]


@pytest.fixture(
    params=[pytest.param("embedded", id="embedded"), pytest.param("nats", id="nats", marks=pytest.mark.nats)]
)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "embedded":
        try:
            import dynamo_cli.runtime.embedded  # noqa: F401
        except ImportError as exc:
            pytest.skip(f"dynamo_cli.runtime.embedded is not importable yet ({exc})")
    return str(request.param)


@pytest.fixture
async def open_bus(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BusOpener]:
    """Start buses that reach each other, as separate processes would; all closed at the end."""
    url = "embedded" if backend == "embedded" else str(request.getfixturevalue("nats_server"))
    opened: list[EventBus | Discovery] = []

    async def start() -> EventBus:
        # The embedded bus finds publishers through discovery, so each bus gets its own client
        # of one shared store; NATS ignores it.
        discovery = open_discovery(f"file://{tmp_path / 'discovery'}")
        await discovery.start()
        opened.append(discovery)
        bus = open_event_bus(url, discovery)
        async with asyncio.timeout(5):
            await bus.start()
        opened.insert(0, bus)
        return bus

    yield start
    for resource in opened:
        await resource.close()


async def wait_until_connected(publisher: EventBus, subscription: Subscription) -> None:
    """Publish a probe until one arrives: ZMQ subscriptions reach publishers asynchronously."""
    async with asyncio.timeout(10):
        while True:
            await publisher.publish(KV_EVENTS, b"probe")
            try:
                async with asyncio.timeout(0.2):
                    await anext(aiter(subscription))  # a fresh iterator: a cancelled generator is spent
                    return
            except TimeoutError:
                continue


async def receive(subscription: Subscription, count: int) -> list[tuple[str, bytes]]:
    messages = aiter(subscription)
    async with asyncio.timeout(10):
        return [await anext(messages) for _ in range(count)]


##### The contract, on every backend #####


async def test_a_publishers_messages_reach_a_subscriber_in_order(open_bus: BusOpener) -> None:
    publisher = await open_bus()
    subscriber = await open_bus()
    subscription = await subscriber.subscribe(KV_EVENTS)
    await wait_until_connected(publisher, subscription)
    await asyncio.sleep(0.3)
    await _drain(subscription)  # late probes

    for i in range(1000):
        await publisher.publish(KV_EVENTS, b"event-%d" % i)
    received = [payload for _, payload in await receive(subscription, 1000)]
    assert received == [b"event-%d" % i for i in range(1000)]
    assert subscription.dropped == 0


async def test_subject_wildcards_match_one_token_or_the_rest(open_bus: BusOpener) -> None:
    publisher = await open_bus()
    subscriber = await open_bus()
    everything = await subscriber.subscribe("namespace.test.>")
    kv_of_any_component = await subscriber.subscribe("namespace.test.component.*.kv-events")
    await wait_until_connected(publisher, everything)
    await wait_until_connected(publisher, kv_of_any_component)
    await asyncio.sleep(0.3)  # let the last probes land before reading what matters

    await _drain(everything)
    await _drain(kv_of_any_component)
    subjects = [
        "namespace.test.component.prefill.kv-events",
        "namespace.test.component.decode.kv-metrics",
        "namespace.other.component.decode.kv-events",
        "namespace.test.component.decode.kv-events",
    ]
    for subject in subjects:
        await publisher.publish(subject, subject.encode())
    assert [s for s, _ in await receive(everything, 3)] == [subjects[0], subjects[1], subjects[3]]
    assert [s for s, _ in await receive(kv_of_any_component, 2)] == [subjects[0], subjects[3]]


async def test_closing_one_subscription_leaves_the_others_on_its_bus_receiving(open_bus: BusOpener) -> None:
    publisher = await open_bus()
    subscriber = await open_bus()
    load = await subscriber.subscribe("namespace.test.component.*.kv-metrics")
    kv = await subscriber.subscribe("namespace.test.component.*.kv-events")
    await wait_until_connected(publisher, kv)
    await load.close()
    await asyncio.sleep(0.3)
    await _drain(kv)

    await publisher.publish("namespace.test.component.decode.kv-metrics", b"load")
    await publisher.publish(KV_EVENTS, b"kv")
    assert await receive(kv, 1) == [(KV_EVENTS, b"kv")]


async def test_a_slow_consumer_drops_and_counts_but_never_blocks_the_publisher(
    open_bus: BusOpener, backend: str
) -> None:
    publisher = await open_bus()
    subscriber = await open_bus()
    subscription = await subscriber.subscribe(KV_EVENTS)
    await wait_until_connected(publisher, subscription)
    await asyncio.sleep(0.3)
    await _drain(subscription)

    num_published = SUBSCRIBER_QUEUE + 10_000
    started = time.monotonic()
    for i in range(num_published):  # nobody reads meanwhile
        await publisher.publish(KV_EVENTS, b"%d" % i)
    assert time.monotonic() - started < 20  # the publisher was never held up by the full queue

    async with asyncio.timeout(20):
        while subscription.dropped == 0:
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # let the rest arrive (and be dropped)
    received = [int(payload) for _, payload in await _drain(subscription) if payload != b"probe"]
    assert subscription.dropped > 0
    assert received == sorted(set(received))  # what got through is in order, no duplicates
    if backend == "nats":  # core NATS on loopback loses nothing else: every message is here or counted
        assert len(received) + subscription.dropped == num_published
        assert received == list(range(len(received)))


##### NATS only: JetStream replay, restarts, unreachable #####


@pytest.mark.nats
async def test_a_late_subscriber_replays_kv_events_from_jetstream_and_resumes_after_its_last_seq(
    nats_server: str,
) -> None:
    publisher, router = NatsEventBus(nats_server), NatsEventBus(nats_server)
    await publisher.start()
    await router.start()
    try:
        for _ in range(2):  # the second call finds the stream and leaves it
            await publisher.ensure_stream(STREAM, ["namespace.test.component.*.kv-events"])
        for i in range(10):
            await publisher.publish(KV_EVENTS, b"before-%d" % i)

        replay = await router.subscribe_replay(KV_EVENTS, stream=STREAM)
        assert [p for _, p in await receive(replay, 10)] == [b"before-%d" % i for i in range(10)]
        assert replay.last_seq == 10
        await replay.close()

        for i in range(3):
            await publisher.publish(KV_EVENTS, b"missed-%d" % i)
        resumed = await router.subscribe_replay(KV_EVENTS, stream=STREAM, start_seq=replay.last_seq + 1)
        await publisher.publish(KV_EVENTS, b"live")
        assert [p for _, p in await receive(resumed, 4)] == [b"missed-0", b"missed-1", b"missed-2", b"live"]
    finally:
        await publisher.close()
        await router.close()


@pytest.mark.nats
async def test_a_stream_whose_subjects_another_stream_captures_is_a_config_error(nats_server: str) -> None:
    bus = NatsEventBus(nats_server)
    await bus.start()
    try:
        await bus.ensure_stream(STREAM, [KV_EVENTS])
        with pytest.raises(ConfigError, match="cannot be created: subjects overlap"):
            await bus.ensure_stream("another", ["namespace.test.>"])
    finally:
        await bus.close()


@pytest.mark.nats
async def test_a_replay_never_drops_even_when_its_consumer_is_slow(nats_server: str) -> None:
    publisher, router = NatsEventBus(nats_server), NatsEventBus(nats_server, queue_size=10)
    await publisher.start()
    await router.start()
    try:
        await publisher.ensure_stream(STREAM, [KV_EVENTS])
        for i in range(500):
            await publisher.publish(KV_EVENTS, b"%d" % i)
        replay = await router.subscribe_replay(KV_EVENTS, stream=STREAM)
        await asyncio.sleep(0.5)  # the queue of 10 is full long before we read
        assert [int(p) for _, p in await receive(replay, 500)] == list(range(500))
        assert replay.dropped == 0 and replay.last_seq == 500
    finally:
        await publisher.close()
        await router.close()


@pytest.mark.nats
async def test_events_resume_after_nats_restarts(nats_process: tests.planes.NatsProcess) -> None:
    publisher, subscriber = NatsEventBus(nats_process.url), NatsEventBus(nats_process.url)
    await publisher.start()
    await subscriber.start()
    try:
        subscription = await subscriber.subscribe(KV_EVENTS)
        await publisher.publish(KV_EVENTS, b"before")
        assert await receive(subscription, 1) == [(KV_EVENTS, b"before")]

        await asyncio.to_thread(nats_process.restart)
        # Both clients reconnect by themselves and resubscribe: a second or two alone, but 10 s ran out
        # once under the whole suite's load.
        async with asyncio.timeout(30):
            while True:
                await publisher.publish(KV_EVENTS, b"after")
                try:
                    async with asyncio.timeout(0.3):
                        if await anext(aiter(subscription)) == (KV_EVENTS, b"after"):
                            break
                except TimeoutError:
                    continue
    finally:
        await publisher.close()
        await subscriber.close()


@pytest.mark.nats
async def test_nats_subscribe_returns_once_the_server_has_the_subscription() -> None:
    """`subscribe` + flush: the PONG it waits for must come after the server read the SUB (a server routes a
    message only to the subscriptions it has processed). A fake server that notes, at each PING, the subjects
    subscribed so far on that connection shows the order on the wire, which a real one cannot."""
    subscribed: list[str] = []
    known_at_pong: list[list[str]] = []

    async def fake_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'INFO {"server_id":"fake","version":"2.10.0","proto":1,"max_payload":1048576}\r\n')
        while line := await reader.readline():
            op, *args = line.split()
            if op == b"SUB":
                subscribed.append(args[0].decode())
            elif op == b"PING":
                known_at_pong.append(list(subscribed))
                writer.write(b"PONG\r\n")
        writer.close()

    server = await asyncio.start_server(fake_server, "127.0.0.1", 0)
    bus = NatsEventBus(f"nats://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        await bus.start()
        for subject in ("a.kv-events", "b.kv-events"):
            await bus.subscribe(subject)
            assert subject in known_at_pong[-1], f"the server answered PONG before it read SUB {subject}"
    finally:
        await bus.close()
        server.close()


@pytest.mark.nats
async def test_a_message_published_right_after_subscribe_reaches_a_fresh_subscriber(nats_server: str) -> None:
    publisher = NatsEventBus(nats_server)
    await publisher.start()
    try:
        for i in range(30):
            subscriber = NatsEventBus(nats_server)
            await subscriber.start()
            try:
                subscription = await subscriber.subscribe(f"{KV_EVENTS}.{i}")
                await publisher.publish(f"{KV_EVENTS}.{i}", b"first")
                async with asyncio.timeout(2):
                    assert await anext(aiter(subscription)) == (f"{KV_EVENTS}.{i}", b"first"), i
            finally:
                await subscriber.close()
    finally:
        await publisher.close()


@pytest.mark.nats
async def test_nats_unreachable_at_start_raises_plane_unavailable_naming_the_address() -> None:
    port = tests.planes.free_port()
    bus = NatsEventBus(f"nats://127.0.0.1:{port}")
    started_at = time.monotonic()
    with pytest.raises(PlaneUnavailable, match=f"nats unreachable at 127.0.0.1:{port}"):
        await bus.start()
    assert time.monotonic() - started_at < 3.5
    await bus.close()


@pytest.mark.nats
async def test_close_is_idempotent_and_ends_open_subscriptions(nats_server: str) -> None:
    bus = NatsEventBus(nats_server)
    await bus.start()
    subscription = await bus.subscribe(KV_EVENTS)
    await bus.close()
    await bus.close()
    assert [m async for m in subscription] == []


def test_nats_urls_parse_to_server_lists() -> None:
    assert parse_nats_url("nats://a:4222,b:4223") == ["nats://a:4222", "nats://b:4223"]


async def _drain(subscription: Subscription) -> list[tuple[str, bytes]]:
    """Everything queued now, without waiting for more."""
    drained = []
    messages = aiter(subscription)
    while True:
        try:
            async with asyncio.timeout(0.2):
                drained.append(await anext(messages))
        except TimeoutError:
            return drained
