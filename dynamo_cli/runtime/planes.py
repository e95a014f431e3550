"""Build the control planes a process's URLs name (discovery, then events on top of it), and open both.

The factories live here, above every backend, so that no backend module imports another: etcd, NATS and
the embedded planes each import only the protocols (discovery.py, events.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

from dynamo_cli.config.common import PlanesConfig
from dynamo_cli.errors import ConfigError, PlaneAuthFailed, PlaneUnavailable
from dynamo_cli.runtime.discovery import DEFAULT_TTL_S, Discovery
from dynamo_cli.runtime.events import EventBus

logger = logging.getLogger(__name__)

RETRY_FIRST_S = 0.5
"""The first wait before a plane unreachable at start is tried again; it doubles up to RETRY_MAX_S."""
RETRY_MAX_S = 5.0


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
async def open_planes(planes: PlanesConfig) -> AsyncIterator[tuple[Discovery, EventBus]]:
    """Discovery (with this process's lease) and the event bus, started; both closed on exit. A plane not
    reachable yet (a first apply on Kubernetes: etcd still binding its volume) is tried again for up to
    `planes.start_wait_s`; refused credentials are not."""
    discovery = await _started(lambda: open_discovery(planes.discovery, ttl=planes.lease_ttl), planes.start_wait_s)
    try:
        bus = await _started(lambda: open_event_bus(planes.events, discovery), planes.start_wait_s)
        try:
            yield discovery, bus
        finally:
            await bus.close()
    finally:
        await discovery.close()


P = TypeVar("P", Discovery, EventBus)


async def _started(build: Callable[[], P], wait_s: float) -> P:
    """A plane built and started, tried again (backing off up to RETRY_MAX_S) while it is unreachable and
    `wait_s` has not passed; then its PlaneUnavailable."""
    loop = asyncio.get_running_loop()
    deadline, pause = loop.time() + wait_s, RETRY_FIRST_S
    while True:
        part = build()
        try:
            await part.start()
            return part
        except BaseException as exc:
            await part.close()
            left = deadline - loop.time()
            if not isinstance(exc, PlaneUnavailable) or isinstance(exc, PlaneAuthFailed) or left <= 0:
                raise
            if pause == RETRY_FIRST_S:
                logger.warning("%s; trying again for up to %.0f s", exc, left)
            await asyncio.sleep(min(pause, left))
            pause = min(RETRY_MAX_S, pause * 2)
