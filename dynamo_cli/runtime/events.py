"""The event plane: fire-and-forget publish/subscribe of small messages by subject.

Workers publish KV events and load metrics; routers and planners subscribe. Subjects follow
Dynamo (`namespace.{ns}.component.{c}.kv-events`). Delivery is at most once on the embedded backend
(ZMQ) and on core NATS; JetStream adds replay for KV events. A subscriber's queue is bounded: when
it is full new messages are dropped and counted (`dropped`), never blocking the publisher.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from dynamo_cli.errors import ConfigError

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


def open_event_bus(url: str, discovery: object) -> EventBus:
    """Build the backend an `--events` URL names: `embedded` (ZMQ, advertised via discovery) or `nats://h:p`."""
    if url.startswith(("nats://", "tls://")):
        from dynamo_cli.runtime.nats import NatsEventBus

        return NatsEventBus(url)
    if url in ("embedded", "", "zmq"):
        from dynamo_cli.runtime.embedded import ZmqEventBus

        return ZmqEventBus(discovery)  # type: ignore[arg-type]
    raise ConfigError(f"--events '{url}' is not understood; use embedded or nats://HOST:PORT")
