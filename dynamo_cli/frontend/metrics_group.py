"""The metrics of the frontends of one `dyn serve --frontends N`: `/metrics` on any of them shows the group's totals.

The frontends share one port (SO_REUSEPORT), so a scrape reaches whichever one the kernel picks, and each must
answer for all. Each keeps its own registry and writes a snapshot of it into the group's directory every
SHARE_INTERVAL_S (`{pid}.json`, replaced atomically); a scrape merges its own live registry with the others'
snapshots, which are at most that old.

NOTE: why not prometheus_client's multiprocess mode: it is process-wide (chosen by an environment variable before
the first metric exists, for every registry of the process), a series cannot be removed (a worker that left would
keep its gauges), and custom collectors are dropped. Why not one registry per process with a `frontend` label: a
scrape of the shared port sees one process, at random. Across hosts (frontend pods) each pod is scraped on its own
and the totals are Prometheus' `sum`, as for any replicated service.

Merging, sample by sample: counters, histograms and summaries add up, and so do gauges (requests in flight, queued),
except the copies of what every frontend hears from the workers (their load, their KV tiers, how many there are),
where the group shows the largest. A frontend that died (its pid gone) keeps its counters and histograms in the
totals, so that they never go back, and loses its gauges. `_created` timestamps take the earliest.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from dynamo_cli.runtime.supervisor import pid_alive

logger = logging.getLogger(__name__)

SHARE_INTERVAL_S = 1.0
"""How often each frontend writes its snapshot: how stale a peer's figures can be in a scrape."""
COPIED_GAUGES = ("dynamo_frontend_worker_", "dynamo_frontend_workers", "kvbm_", "dynamo_frontend_kv_transfer_gbps")
"""Gauge families (by name prefix) that every frontend copies from the workers' reports: shown once, not summed."""
OWN_GAUGES = ("dynamo_frontend_worker_inflight_requests",)
"""Exceptions to COPIED_GAUGES: each frontend's own part of it."""
CUMULATIVE = frozenset({"counter", "histogram", "summary", "gaugehistogram"})


class Family(msgspec.Struct, array_like=True, frozen=True):
    """One metric family of a snapshot: its name, type, help and samples (sample name, labels, value)."""

    name: str
    type: str
    documentation: str
    samples: list[tuple[str, dict[str, str], float]]


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(list[Family]).decode


def snapshot(registry: CollectorRegistry) -> list[Family]:
    """The registry's families now."""
    return [
        Family(m.name, m.type, m.documentation, [(s.name, s.labels, s.value) for s in m.samples])
        for m in registry.collect()
    ]


def _is_copy(family: str) -> bool:
    return family.startswith(COPIED_GAUGES) and family not in OWN_GAUGES


def merge(own: list[Family], others: list[tuple[list[Family], bool]]) -> list[Family]:
    """`own` plus every other snapshot, (families, is the process alive); see the module's rules."""
    merged: dict[str, tuple[Family, dict[tuple[str, tuple[tuple[str, str], ...]], float]]] = {}
    for families, alive in [(own, True), *others]:
        for family in families:
            if not alive and family.type not in CUMULATIVE:
                continue  # a dead frontend's gauges: nothing of it is in flight any more
            _, values = merged.setdefault(family.name, (family, {}))
            copy = family.type == "gauge" and _is_copy(family.name)
            for name, labels, value in family.samples:
                key = (name, tuple(sorted(labels.items())))
                if key not in values:
                    values[key] = value
                elif name.endswith("_created"):
                    values[key] = min(values[key], value)
                else:
                    values[key] = max(values[key], value) if copy else values[key] + value
    return [
        Family(f.name, f.type, f.documentation, [(name, dict(labels), v) for (name, labels), v in values.items()])
        for f, values in merged.values()
    ]


class MergedFamilies:
    """What generate_latest reads: merged families as prometheus_client's Metric objects."""

    def __init__(self, families: list[Family]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            metric = Metric(family.name, family.documentation, family.type)
            for name, labels, value in family.samples:
                metric.add_sample(name, labels, value)
            yield metric


class MetricsGroup:
    """One frontend's part of the group: shares its snapshot, and merges the others' into its /metrics."""

    def __init__(self, directory: Path, registry: CollectorRegistry) -> None:
        self.directory = directory
        self._registry = registry
        self._pid = os.getpid()
        self._own = directory / f"{self._pid}.json"

    async def share(self, refresh: Callable[[], None]) -> None:
        """Write this frontend's snapshot every SHARE_INTERVAL_S (after `refresh`, which sets the gauges read at
        scrape time); runs until cancelled."""
        while True:
            try:
                self.write(refresh)
            except OSError as exc:  # the directory went (the parent stopping): try again, say it once
                logger.debug("frontend metrics snapshot not written: %s", exc)
            await asyncio.sleep(SHARE_INTERVAL_S)

    def write(self, refresh: Callable[[], None]) -> None:
        refresh()
        part = self._own.with_suffix(".part")
        part.write_bytes(_encode(snapshot(self._registry)))
        os.replace(part, self._own)

    def merged(self, refresh: Callable[[], None]) -> bytes:
        """The exposition text of the group's totals: this registry live, the others' last snapshots."""
        refresh()
        others: list[tuple[list[Family], bool]] = []
        for path in self.directory.glob("*.json"):
            if path == self._own or not path.stem.isdigit():
                continue
            try:
                others.append((_decode(path.read_bytes()), pid_alive(int(path.stem))))
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.debug("skipping the frontend metrics snapshot %s: %s", path, exc)
        return generate_latest(MergedFamilies(merge(snapshot(self._registry), others)))
