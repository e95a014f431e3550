"""Open both control planes of a process (discovery, then events on top of it) and close them in reverse."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from dynamo_cli.runtime.discovery import Discovery, open_discovery
from dynamo_cli.runtime.events import EventBus, open_event_bus


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
