"""A process's system server: `/live`, `/health` and `/metrics` on a port of its own (Dynamo's `DYN_SYSTEM_PORT`).

What a probe or a Prometheus scrape of a worker or a `dyn router` reads. The server is a few lines of HTTP/1.1
on the process's own loop (one request per connection, GET only, a bounded request head read under a timeout),
so it costs nothing between scrapes and pulls in no web framework. It is read-only: it may face strangers.

    /live     200 while the process's loop runs
    /health   200 when the process is ready to serve (its owner's `Health` says), else 503 and why
    /metrics  the Prometheus text of the owner's registries, then of the process-global one (where an
              engine library registers its own series, such as vLLM's `vllm:*`)

The request plane's per-endpoint figures (`EndpointStats`, counted by `RequestServer`) are exported here as
Dynamo's `dynamo_component_*` series.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import msgspec
import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from dynamo_cli.errors import ConfigError
from dynamo_cli.runtime.handshake import is_loopback
from dynamo_cli.runtime.stats import DURATION_BUCKETS
from dynamo_cli.runtime.transport import RequestServer

logger = logging.getLogger(__name__)

HEAD_LIMIT = 8192
"""Bytes of request line and headers read at most; a longer head is refused."""
READ_TIMEOUT_S = 5.0
"""A client that sends no complete head in this time is dropped."""
HEALTH_TIMEOUT_S = 5.0
"""A health check that takes longer answers 503."""
SYSTEM_ROUTES = {
    "/live": "200 while the process's loop runs",
    "/health": "200 when the process is ready to serve (its owner's `Health` says), else 503 and why",
    "/metrics": "The Prometheus text of the owner's registries, then of the process-global one",
}
"""Path -> what it answers (GET or HEAD): every route of a system server (docs/reference/http.md lists them)."""


class ServingState(enum.Enum):
    """Where a serving process (a worker, `dyn router`) is in its life, as `/health` reports it."""

    STARTING = "starting"
    """Loading (an engine) or waiting (for a backend); not registered yet."""
    READY = "ready"
    """Registered: callers send it requests."""
    DRAINING = "draining"
    """Deregistered on SIGTERM; finishing the streams in flight."""


@dataclass(frozen=True, slots=True)
class HealthReport:
    """The owner's answer to `/health`."""

    is_ready: bool
    status: str
    """`ready`, or why not: `starting`, `draining`, `unhealthy`."""
    detail: dict[str, object] = field(default_factory=dict)
    """What else the body shows (the engine check, the instance id ...)."""


Health = Callable[[], Awaitable[HealthReport]]


class ComponentMetrics(Collector):
    """Dynamo's `dynamo_component_*` series of one process's request plane, read from its `RequestServer` at
    scrape time (labels dynamo_namespace, dynamo_component, dynamo_endpoint)."""

    def __init__(self, server: RequestServer, namespace: str, component: str) -> None:
        self.server = server
        self.labels = [namespace, component]
        self.started = time.time()

    def collect(self) -> Iterator[Metric]:
        names = ["dynamo_namespace", "dynamo_component", "dynamo_endpoint"]
        prefix = "dynamo_component_"
        inflight = GaugeMetricFamily(f"{prefix}inflight_requests", "Requests being served", labels=names)
        counters = {
            "requests": CounterMetricFamily(f"{prefix}requests", "Requests received", labels=names),
            "errors": CounterMetricFamily(f"{prefix}errors", "Requests that ended in an error", labels=names),
            "cancelled": CounterMetricFamily(f"{prefix}cancellation", "Requests cancelled by the caller", labels=names),
            "request_bytes": CounterMetricFamily(f"{prefix}request_bytes", "Request bytes received", labels=names),
            "response_bytes": CounterMetricFamily(f"{prefix}response_bytes", "Response bytes sent", labels=names),
        }
        duration = HistogramMetricFamily(
            f"{prefix}request_duration_seconds", "Time from request to its end", labels=names
        )
        bounds = [*(str(b) for b in DURATION_BUCKETS), "+Inf"]
        for endpoint, stats in sorted(self.server.stats.items()):
            labels = [*self.labels, endpoint]
            inflight.add_metric(labels, stats.inflight)
            for field_name, family in counters.items():
                family.add_metric(labels, getattr(stats, field_name))
            cumulative = list(itertools.accumulate(stats.duration_counts))
            duration.add_metric(labels, list(zip(bounds, cumulative, strict=True)), stats.duration_sum)
        uptime = GaugeMetricFamily(f"{prefix}uptime_seconds", "Seconds since the process started", labels=names[:2])
        uptime.add_metric(self.labels, time.time() - self.started)
        yield from (inflight, *counters.values(), duration, uptime)


class SystemServer:
    """Serves `/live`, `/health` and `/metrics` on `host:port` (0: any free port) until closed."""

    def __init__(
        self,
        host: str,
        port: int,
        health: Health,
        registries: Sequence[CollectorRegistry],
        on_scrape: Callable[[], None] | None = None,
    ) -> None:
        self._on_scrape = on_scrape
        """Sets the owner's gauges that are read, not counted (queue lengths ...), before each /metrics."""
        self._host = host
        self._port = port
        self._health = health
        self._registries = [*registries, prometheus_client.REGISTRY]
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self.address = ""

    async def start(self) -> str:
        """Listen; the `host:port` it serves on. Exposed beyond loopback, it warns: it serves read-only figures."""
        if not is_loopback(self._host):
            logger.info("system server on %s: reachable beyond this host (it serves read-only figures)", self._host)
        try:
            self._server = await asyncio.start_server(self._accept, self._host, self._port, limit=HEAD_LIMIT)
        except OSError as exc:
            raise ConfigError(f"--system-port {self._port}: cannot listen on {self._host} ({exc.strerror})") from None
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{self._host}:{port}"
        return self.address

    def serve_for(self, health: Health, registries: Sequence[CollectorRegistry]) -> None:
        """Answer for a part built after the port was bound (a worker, once its engine is loaded): its health and
        its series from now on."""
        self._health = health
        self._registries = [*registries, prometheus_client.REGISTRY]

    async def close(self) -> None:
        """Stop listening and end the requests being answered. Idempotent."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._handlers):
            task.cancel()
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=1.0)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            async with asyncio.timeout(READ_TIMEOUT_S + HEALTH_TIMEOUT_S):
                await self._answer(reader, writer)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass  # a slow, closed or oversized request: dropped
        finally:
            self._handlers.discard(task)
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with asyncio.timeout(READ_TIMEOUT_S):
            head = await reader.readuntil(b"\r\n\r\n")
        method, _, rest = head.partition(b" ")
        path = rest.partition(b" ")[0].partition(b"?")[0].decode("latin-1")
        if method not in (b"GET", b"HEAD"):
            status, body, kind = 405, _json({"error": "only GET is served here"}), "application/json"
        else:
            status, body, kind = await self._route(path)
        header = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}\r\nContent-Type: {kind}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        writer.write(header.encode() + (b"" if method == b"HEAD" else body))
        await writer.drain()

    async def _route(self, path: str) -> tuple[int, bytes, str]:
        if path == "/live":
            return 200, _json({"status": "live"}), "application/json"
        if path == "/health":
            try:
                async with asyncio.timeout(HEALTH_TIMEOUT_S):
                    report = await self._health()
            except TimeoutError:
                report = HealthReport(False, "unhealthy", {"reason": f"no answer within {HEALTH_TIMEOUT_S:.0f} s"})
            return (
                200 if report.is_ready else 503,
                _json({"status": report.status, **report.detail}),
                "application/json",
            )
        if path == "/metrics":
            if self._on_scrape is not None:
                self._on_scrape()
            return 200, b"".join(_exposition(self._registries)), prometheus_client.CONTENT_TYPE_LATEST
        return 404, _json({"error": f"no route {path}; try {', '.join(SYSTEM_ROUTES)}"}), "application/json"


def _exposition(registries: Iterable[CollectorRegistry]) -> Iterator[bytes]:
    for registry in registries:
        yield prometheus_client.generate_latest(registry)


def _json(value: object) -> bytes:
    return msgspec.json.encode(value)


_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}
