"""The event plane: fire-and-forget publish/subscribe of small messages by subject.

Workers publish KV events and load metrics; routers and planners subscribe. Subjects follow
Dynamo (`namespace.{ns}.component.{c}.kv-events`). Delivery is at most once on the embedded backend
(ZMQ) and on core NATS; JetStream adds replay for KV events. A subscriber's queue is bounded: when
it is full new messages are dropped and counted (`dropped`), never blocking the publisher.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, runtime_checkable

import msgspec

logger = logging.getLogger(__name__)

SUBSCRIBER_QUEUE = 65_536
"""Messages buffered per subscription before drops are counted."""


class Subscription(Protocol):
    """An open subscription; iterate for (subject, payload) pairs."""

    dropped: int
    """Messages dropped because the consumer was slower than the publishers."""

    def __aiter__(self) -> AsyncIterator[tuple[str, bytes]]: ...

    async def close(self) -> None: ...


class EventBus(Protocol):
    """Publish/subscribe by subject across processes."""

    async def start(self) -> None:
        """Connect (or bind); raise PlaneUnavailable when the server is unreachable."""
        ...

    async def publish(self, subject: str, payload: bytes) -> None:
        """Send without waiting for any subscriber."""
        ...

    async def subscribe(self, subject: str) -> Subscription:
        """Receive every message published on `subject` from now on (prefix `foo.>` allowed)."""
        ...

    async def close(self) -> None:
        """Flush and disconnect. Idempotent."""
        ...


@runtime_checkable
class DurableStreams(Protocol):
    """An event bus that can keep a subject's messages in a stream and replay them (NATS JetStream)."""

    async def ensure_stream(self, name: str, subjects: list[str]) -> None:
        """Create stream `name` capturing `subjects` unless it exists."""
        ...

    async def subscribe_replay(self, subject: str, *, stream: str, start_seq: int = 1) -> Subscription:
        """Every kept message of `stream` on `subject` from `start_seq` on, then new ones."""
        ...


async def pump(sub: Subscription, apply: Callable[[Any], None], kind: type) -> None:
    """Decode every message of `sub` as msgpack `kind` and apply it; undecodable ones are logged and
    skipped. Runs until cancelled, then closes `sub`."""
    decode: Callable[[bytes], Any] = msgspec.msgpack.Decoder(kind).decode
    try:
        async for subject, payload in sub:
            try:
                apply(decode(payload))
            except msgspec.DecodeError:
                logger.warning("dropping an undecodable %s message on %s", kind.__name__, subject)
    finally:
        await sub.close()


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS-style match: `*` is one token, a trailing `>` is one or more tokens."""
    if pattern == subject:
        return True
    pat, sub = pattern.split("."), subject.split(".")
    for i, part in enumerate(pat):
        if part == ">":
            return len(sub) > i
        if i >= len(sub) or (part != "*" and part != sub[i]):
            return False
    return len(pat) == len(sub)


def kv_stream_name(namespace: str) -> str:
    """The JetStream stream that keeps a namespace's KV events for routers that start late."""
    return f"DYN_KV_{namespace}"


async def ensure_kv_stream(bus: EventBus, namespace: str, subject: str) -> None:
    """Make KV events durable where the backend can (NATS JetStream); a no-op elsewhere."""
    if isinstance(bus, DurableStreams):
        await bus.ensure_stream(kv_stream_name(namespace), [subject])


async def subscribe_kv_events(bus: EventBus, namespace: str, subject: str) -> Subscription:
    """Subscribe to KV events, replaying what the stream kept when the backend can (a late router
    catches up); otherwise from now on (gaps are then repaired from the workers)."""
    if not isinstance(bus, DurableStreams):
        return await bus.subscribe(subject)
    await bus.ensure_stream(kv_stream_name(namespace), [subject])
    return await bus.subscribe_replay(subject, stream=kv_stream_name(namespace), start_seq=1)
