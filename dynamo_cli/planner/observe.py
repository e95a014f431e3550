"""What the planner sees: the frontends' Prometheus counters over an interval, and the workers in discovery.

Frontends are read over HTTP (`GET /metrics`), so the planner needs no code of theirs: Dynamo's
`dynamo_frontend_*` histograms give requests completed and mean TTFT, ITL, ISL, OSL and duration as
increase(sum) / increase(count) between two scrapes, summed over every model and frontend; requests that
arrived are those completed plus the growth of `dynamo_frontend_inflight_requests` (queued ones included).
Workers are counted from their instance records under `v1/instances/{namespace}/`, and the data-parallel ranks each
serves read from its model card beside it (`dp_size`; a pool's most common one). Each `dyn serve`
frontend registers its URL under `v1/frontends/{namespace}/{lease:x}` (leased), so a planner given no
`--frontend` finds every frontend of its namespace there, at every scrape. `dyn serve --planner` reads its
own frontend's registry in-process (`TextSnapshotter`), so TLS and API keys on /metrics do not get in the way.

The workers' per-step load comes over the event plane as the routers get it: every worker publishes its
`LoadMetrics` on `namespace.{ns}.component.{c}.kv-metrics` when it changes and at least every 0.5 s;
`WorkerLoads` keeps each worker's latest and sums the pool (a worker not heard from for `stale_s` is gone).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from dynamo_cli.errors import PlaneUnavailable
from dynamo_cli.model_card import ModelCard
from dynamo_cli.planner.sizing import Observation, RanksPerWorker
from dynamo_cli.runtime.discovery import Discovery
from dynamo_cli.runtime.events import EventBus, pump
from dynamo_cli.runtime.names import component_subject, frontends_prefix, parse_instance_key
from dynamo_cli.wire import LoadMetrics

logger = logging.getLogger(__name__)

PREFIX = "dynamo_frontend_"
HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "input_sequence_tokens",
    "output_sequence_tokens",
    "request_duration_seconds",
)
SCRAPE_TIMEOUT_S = 5.0
ROUTER_COMPONENT = "router"  # `dyn router` replicas register beside workers; they are not workers


class FrontendRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A frontend's discovery record: where its HTTP API (and /metrics) is."""

    url: str


async def discovered_frontends(discovery: Discovery, namespace: str) -> list[str]:
    """URLs of the frontends registered in `namespace`, each once (the frontends of one `dyn serve --frontends N`
    share one URL and one /metrics)."""
    return sorted(set(await frontend_urls(discovery, namespace)))


async def frontend_urls(discovery: Discovery, namespace: str) -> list[str]:
    """The URL of each frontend registered in `namespace` (a URL once per frontend on it)."""
    async with asyncio.timeout(SCRAPE_TIMEOUT_S):
        found = await discovery.get_prefix(frontends_prefix(namespace))
    urls = []
    for raw in found.values():
        try:
            urls.append(msgspec.json.decode(raw, type=FrontendRecord).url)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
    return urls


UrlSource = Callable[[], Awaitable[list[str]]]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Cumulative frontend counters at one moment."""

    at: float
    """Monotonic time of the scrape."""
    sums: dict[str, float]
    """Histogram name (without prefix) → cumulative sum (and `name:count` → cumulative count)."""
    inflight: float
    """Requests in flight now, over every frontend."""


def parse_metrics(text: str) -> tuple[dict[str, float], float]:
    """(histogram sums and counts, requests in flight) from one frontend's /metrics text."""
    sums: dict[str, float] = {}
    inflight = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix(PREFIX)
            if name == "inflight_requests":
                inflight += sample.value
            for histogram in HISTOGRAMS:
                if name == f"{histogram}_sum":
                    sums[histogram] = sums.get(histogram, 0.0) + sample.value
                elif name == f"{histogram}_count":
                    sums[f"{histogram}:count"] = sums.get(f"{histogram}:count", 0.0) + sample.value
    return sums, inflight


def _mean(now: Snapshot, before: Snapshot, name: str) -> tuple[float, float]:
    count = now.sums.get(f"{name}:count", 0.0) - before.sums.get(f"{name}:count", 0.0)
    total = now.sums.get(name, 0.0) - before.sums.get(name, 0.0)
    return (total / count if count > 0 else 0.0), count


def observation_between(before: Snapshot, now: Snapshot) -> Observation:
    """The interval's traffic: completed requests and mean latencies (a restarted frontend's reset counters
    read as no traffic rather than negative traffic)."""
    duration, num_requests = _mean(now, before, "request_duration_seconds")
    ttft, _ = _mean(now, before, "time_to_first_token_seconds")
    itl, _ = _mean(now, before, "inter_token_latency_seconds")
    isl, _ = _mean(now, before, "input_sequence_tokens")
    osl, _ = _mean(now, before, "output_sequence_tokens")
    if num_requests < 0:
        num_requests = duration = ttft = itl = isl = osl = 0.0
    arrived = max(0.0, num_requests + now.inflight - before.inflight)
    return Observation(
        interval_s=max(now.at - before.at, 1e-3),
        num_requests=num_requests,
        isl=isl,
        osl=osl,
        ttft_ms=ttft * 1000,
        itl_ms=itl * 1000,
        request_duration_s=duration,
        arrived=arrived,
    )


class FrontendScraper:
    """Reads every frontend's /metrics; a frontend that does not answer is logged and left out."""

    def __init__(self, urls: list[str] | UrlSource, client: httpx.AsyncClient) -> None:
        self.urls = [url.rstrip("/") for url in urls] if isinstance(urls, list) else []
        self.find = None if isinstance(urls, list) else urls
        """Where to find the frontends before each scrape (discovery), unless fixed URLs were given."""
        self.client = client

    async def _one(self, url: str) -> str | None:
        try:
            response = await self.client.get(f"{url}/metrics", timeout=SCRAPE_TIMEOUT_S)
            response.raise_for_status()
            return response.text
        except httpx.HTTPError as exc:
            logger.warning("frontend %s/metrics unreadable: %s", url, exc)
            return None

    async def snapshot(self) -> Snapshot:
        if self.find is not None:
            self.urls = [url.rstrip("/") for url in await self.find()]
        texts = await asyncio.gather(*(self._one(url) for url in self.urls))
        if all(text is None for text in texts):
            raise PlaneUnavailable(
                "frontend /metrics",
                ", ".join(self.urls) or "discovery",
                "no frontend answered; start `dyn serve` or pass --frontend URL",
            )
        sums: dict[str, float] = {}
        inflight = 0.0
        for text in texts:
            if text is None:
                continue
            one, busy = parse_metrics(text)
            inflight += busy
            for key, value in one.items():
                sums[key] = sums.get(key, 0.0) + value
        return Snapshot(at=time.monotonic(), sums=sums, inflight=inflight)


class TextSnapshotter:
    """Reads metrics text from a callable rather than over HTTP: `dyn serve --planner`'s own frontend."""

    def __init__(self, read: Callable[[], str]) -> None:
        self.read = read

    async def snapshot(self) -> Snapshot:
        sums, inflight = parse_metrics(self.read())
        return Snapshot(at=time.monotonic(), sums=sums, inflight=inflight)


class _Record(msgspec.Struct, kw_only=True):
    component: str = ""
    role: str = ""


@dataclass(frozen=True, slots=True)
class WorkerCount:
    """The workers registered in a namespace, per pool, and the data-parallel ranks each serves."""

    num_prefill: int = 0
    """Prefill workers."""
    num_decode: int = 0
    """Decode (agg: aggregated) workers."""
    prefill_ranks: int = 0
    """The prefill workers' most common card `dp_size` (0: no prefill worker to read it from)."""
    decode_ranks: int = 0
    """The decode workers' most common card `dp_size` (0: none)."""
    mixed: str = ""
    """The pools whose workers' cards disagree on `dp_size`, e.g. `decode: 3 of 4 ranks, 1 of 2 ranks` (workers
    of each; "" when every pool agrees)."""

    @property
    def counts(self) -> tuple[int, int]:
        """(prefill, decode) workers."""
        return self.num_prefill, self.num_decode

    @classmethod
    def of(cls, prefill: list[int], decode: list[int]) -> WorkerCount:
        """From each prefill and decode worker's `dp_size`."""
        (p_ranks, p_mixed), (d_ranks, d_mixed) = _most_common(prefill, "prefill"), _most_common(decode, "decode")
        mixed = "; ".join(text for text in (p_mixed, d_mixed) if text)
        return cls(len(prefill), len(decode), p_ranks, d_ranks, mixed)


def _most_common(sizes: list[int], pool: str) -> tuple[int, str]:
    """The most common of `sizes` (ties: the fewest ranks, which sizes for more workers), and a line when they
    differ; (0, "") for none."""
    if not sizes:
        return 0, ""
    tally = Counter(sizes).most_common()
    top = min(size for size, n in tally if n == tally[0][1])
    if len(tally) == 1:
        return top, ""
    return top, f"{pool}: " + ", ".join(
        f"{n} of {size} ranks" for size, n in sorted(tally, key=lambda t: (-t[1], t[0]))
    )


def _dp_size(card: bytes | None) -> int:
    """The ranks a worker's card says it serves (1: a rank-blind card, or none yet)."""
    try:
        return msgspec.json.decode(card, type=ModelCard).dp_size if card is not None else 1
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 1


async def count_workers(discovery: Discovery, namespace: str) -> WorkerCount:
    """The prefill and decode-or-aggregated workers registered in `namespace`, and each pool's ranks per worker
    (its workers' cards' most common `dp_size`)."""
    async with asyncio.timeout(SCRAPE_TIMEOUT_S):
        found = await discovery.get_prefix(f"v1/instances/{namespace}/")
        cards = await discovery.get_prefix(f"v1/mdc/{namespace}/")
    sizes: dict[str, list[int]] = {"prefill": [], "decode": []}
    for key, raw in found.items():
        try:
            record = msgspec.json.decode(raw, type=_Record)
            name, instance_id = parse_instance_key(key)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
            continue
        if record.component == ROUTER_COMPONENT:
            continue
        pool = "prefill" if record.role == "prefill" else "decode"
        sizes[pool].append(_dp_size(cards.get(name.card_key(instance_id))))
    return WorkerCount.of(sizes["prefill"], sizes["decode"])


@dataclass(slots=True)
class WorkerRanks:
    """Each pool's data-parallel ranks per worker, as the planner sizes with them: `fixed`, else the latest its
    workers' cards said; a pool with no worker keeps what it had (1 until one is read)."""

    fixed: int = 0
    """`--ranks-per-worker` (0: from the cards)."""
    now: RanksPerWorker = field(init=False)
    """The ranks sized with now."""
    _mixed: str = ""
    """The latest disagreement among the cards that was logged."""

    def __post_init__(self) -> None:
        self.now = RanksPerWorker.every(self.fixed or 1)

    def read(self, count: WorkerCount) -> RanksPerWorker:
        """Take each pool's ranks from `count` (unless `fixed`); log a change, and a disagreement once, as it
        changes."""
        if self.fixed > 0:
            return self.now
        ranks = RanksPerWorker(count.prefill_ranks or self.now.prefill, count.decode_ranks or self.now.decode)
        if ranks != self.now:
            logger.info("workers serve %d (prefill) and %d (decode) ranks each", ranks.prefill, ranks.decode)
            self.now = ranks
        if count.mixed != self._mixed:
            self._mixed = count.mixed
            if count.mixed:
                logger.warning(
                    "workers' cards disagree on their ranks (%s): sizing for the most common (prefill %d, decode "
                    "%d); set --ranks-per-worker to choose",
                    count.mixed,
                    ranks.prefill,
                    ranks.decode,
                )
        return self.now


@dataclass(frozen=True, slots=True)
class PoolLoad:
    """The workers' latest per-step load, summed over the pool."""

    num_workers: int = 0
    """Workers heard from lately."""
    num_running: int = 0
    """Requests being prefilled or decoded."""
    num_waiting: int = 0
    """Requests queued at the workers, not yet admitted: grows only when the pool is saturated."""
    active_blocks: int = 0
    """KV blocks in use."""
    total_blocks: int = 0
    """KV blocks in all."""


@dataclass(slots=True)
class WorkerLoads:
    """Each worker's latest `LoadMetrics` (by worker id) and when it came."""

    stale_s: float = 5.0
    """A worker not heard from for this long is left out (ten of its heartbeats)."""
    clock: Callable[[], float] = time.monotonic
    _latest: dict[int, tuple[float, LoadMetrics]] = field(default_factory=dict)

    def apply(self, metrics: LoadMetrics) -> None:
        self._latest[metrics.worker_id] = (self.clock(), metrics)

    def total(self) -> PoolLoad:
        """The pool's load now."""
        now = self.clock()
        for worker, (at, _) in list(self._latest.items()):
            if now - at > self.stale_s:
                del self._latest[worker]
        loads = [metrics for _, metrics in self._latest.values()]
        return PoolLoad(
            num_workers=len(loads),
            num_running=sum(m.num_running for m in loads),
            num_waiting=sum(m.num_waiting for m in loads),
            active_blocks=sum(m.active_blocks for m in loads),
            total_blocks=sum(m.total_blocks for m in loads),
        )


async def follow_worker_loads(bus: EventBus, namespace: str, loads: WorkerLoads) -> None:
    """Feed `loads` from every component's `kv-metrics` subject in `namespace` until cancelled."""
    subscription = await bus.subscribe(component_subject(namespace, "*", "kv-metrics"))
    await pump(subscription, loads.apply, LoadMetrics)
