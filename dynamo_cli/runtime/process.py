"""The skeleton every `dyn` process runs (Dynamo's DistributedRuntime + `serve_endpoint` shape).

A process is a short list of parts handed to a `Process`: what it opens (a request server, a system port, an
engine, a registry) it `opens`, and the skeleton closes them in reverse order on the way out, after cancelling the
background tasks it owns and before its tracing is shut (the last spans exported). A request-plane process (a
worker, `dyn router`) hands it a `Served` too: `serve` registers its one endpoint once the card is known, prints
the ready line, waits for the stop, then deregisters first and drains the streams in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from dynamo_cli.runtime.discovery import Discovery
from dynamo_cli.runtime.endpoint import Endpoint
from dynamo_cli.runtime.names import EndpointName
from dynamo_cli.runtime.supervisor import ServiceTasks, freeze_heap, ready_line
from dynamo_cli.runtime.system import ServingState, SystemServer
from dynamo_cli.runtime.transport import RequestServer, Spec

Loop = Coroutine[Any, Any, None]


class Shuts(Protocol):
    """A process's tracing: shut last, so the spans of the way out are exported."""

    def shutdown(self) -> None: ...


class Process:
    """One process's background tasks, the parts it opened (closed in reverse) and its tracing (shut last)."""

    def __init__(self, what: str, tracing: Shuts | None = None) -> None:
        self.what = what
        """The ready line's word: `serve`, `worker`, `router`, `planner`."""
        self.tasks = ServiceTasks()
        self.tracing = tracing
        self.state = ServingState.STARTING
        """What `/health` says: starting, ready once `ready` ran, draining once the stop came."""
        self._closes: list[Callable[[], Awaitable[None]]] = []
        self._front: list[Callable[[], Awaitable[None]]] = []

    def opens(self, close: Callable[[], Awaitable[None]], *, front: bool = False) -> None:
        """A part is open: `close` runs on the way out, the parts opened later closed before it. `front`: a
        part callers reach (a request server), closed before every other, so none of its streams outlives the
        parts behind it."""
        (self._front if front else self._closes).append(close)

    def ready(self, detail: str, announce: Callable[[str], None]) -> None:
        """Serving: the one ready line, and the heap built so far out of the collector's reach."""
        self.state = ServingState.READY
        announce(ready_line(self.what, detail))
        freeze_heap()

    async def __aenter__(self) -> Process:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await self.tasks.close()
            for closes in (self._front, self._closes):
                while closes:
                    await closes.pop()()
        finally:
            if self.tracing is not None:
                self.tracing.shutdown()


@dataclass(frozen=True, slots=True)
class Serving:
    """What a request-plane process registers once it can serve, and what it runs while registered."""

    spec: Spec[Any, Any]
    handler: Callable[[Any], AsyncIterator[Any]]
    card: msgspec.Struct
    """The discovery body its callers read (a model card)."""
    role: str
    detail: str
    """The ready line's tail after the instance and address (`model=... engine=...`)."""
    loops: Callable[[Endpoint], list[Loop]] = field(default=lambda endpoint: [])
    """The loops it runs once registered, given its endpoint (cancelled on the way out)."""


class Served(Protocol):
    """A request-plane process's own part of the skeleton."""

    @property
    def name(self) -> EndpointName: ...

    @property
    def server(self) -> RequestServer: ...

    async def begin(self, process: Process, stop: asyncio.Event) -> Serving | None:
        """Start what serving needs (an engine; routing loops and a backend's card), opening its parts on
        `process`; None: the stop came first."""
        ...


async def serve(
    process: Process,
    served: Served,
    discovery: Discovery,
    stop: asyncio.Event,
    announce: Callable[[str], None],
    *,
    grace_s: float,
    system: SystemServer | None = None,
) -> None:
    """Run `served` in `process` until `stop`: its request server and system port (`--system-port`), what its
    `begin` starts, then its endpoint registered until the stop, deregistered and drained within `grace_s` on the
    way out."""
    async with process:
        address = await served.server.start()
        process.opens(served.server.close, front=True)
        system_text = ""
        if system is not None:
            system_text = f" system={system.address or await system.start()}"  # bound early by a worker
            process.opens(system.close)
        serving = await served.begin(process, stop)
        if serving is None:
            return
        endpoint = Endpoint(served.name, discovery)
        async with endpoint.serve_endpoint(
            served.server, serving.spec, serving.handler, serving.card, role=serving.role, grace_s=grace_s
        ):
            for loop in serving.loops(endpoint):
                process.tasks.spawn(loop)
            where = f"instance={served.name}/{discovery.lease_id:x} address={address}"
            process.ready(f"{where} {serving.detail}{system_text}", announce)
            await process.tasks.wait_stop(stop)
            process.state = ServingState.DRAINING  # leaving the block deregisters, then drains
