"""Build the control planes a process's URLs name (discovery, then events on top of it), and open both.

The factories live here, above every backend, so that no backend module imports another: etcd, NATS and
the embedded planes each import only the protocols (discovery.py, events.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from dynamo_cli.errors import ConfigError
from dynamo_cli.runtime.discovery import DEFAULT_TTL_S, Discovery
from dynamo_cli.runtime.events import EventBus


def open_discovery(url: str, *, ttl: float = DEFAULT_TTL_S) -> Discovery:
    """Build the backend a `--discovery` URL names: `embedded[:///dir]`, `file:///dir` or
    `etcd[s]://[user:password@]h:p[,h:p][?ca=…]` (runtime/urls.py)."""
    if url.startswith(("etcd://", "etcds://")):
        from dynamo_cli.runtime.etcd import EtcdDiscovery

        return EtcdDiscovery(url, ttl=ttl)
    if url in ("embedded", "") or url.startswith(("file://", "embedded://")):
        from dynamo_cli.runtime.embedded import FileDiscovery, embedded_root

        return FileDiscovery(embedded_root(url), ttl=ttl)
    raise ConfigError(f"--discovery '{url}' is not understood; use embedded, file:///DIR or etcd://HOST:PORT")


def open_event_bus(url: str, discovery: object) -> EventBus:
    """Build the backend an `--events` URL names: `embedded` (ZMQ, advertised via discovery) or `nats://h:p`."""
    if url.startswith(("nats://", "tls://")):
        from dynamo_cli.runtime.nats import NatsEventBus

        return NatsEventBus(url)
    if url in ("embedded", "", "zmq"):
        from dynamo_cli.runtime.embedded import ZmqEventBus

        return ZmqEventBus(discovery)  # type: ignore[arg-type]
    raise ConfigError(f"--events '{url}' is not understood; use embedded or nats://HOST:PORT")


@asynccontextmanager
async def open_planes(discovery_url: str, events_url: str, ttl: float) -> AsyncIterator[tuple[Discovery, EventBus]]:
    """Discovery (with this process's lease) and the event bus, started; both closed on exit."""
    discovery = open_discovery(discovery_url, ttl=ttl)
    await discovery.start()
    bus = open_event_bus(events_url, discovery)
    try:
        await bus.start()
        yield discovery, bus
    finally:
        await bus.close()
        await discovery.close()
