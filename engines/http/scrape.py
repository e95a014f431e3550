"""The backend's own load, read from its Prometheus `/metrics` where it has one (vLLM's `vllm:*`, SGLang's
`sglang:*`): requests running and waiting there, from every client, and how full its KV cache is. A backend with no
such series is not asked again."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx

logger = logging.getLogger(__name__)

SCRAPE_S = 1.0
"""How often the backend's `/metrics` is read."""

MAX_METRICS_BYTES = 1 << 20
"""The most of a `/metrics` body read (a vLLM server's is about 50 kB)."""

SERIES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:token_usage": "kv_usage",
}
"""Series name -> what it says (summed over the series' labels: engines, data-parallel ranks)."""


@dataclass(frozen=True, slots=True)
class BackendLoad:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    """The fraction of its KV cache in use, 0..1."""


def parse(text: str) -> BackendLoad | None:
    """The load in a Prometheus text body; None when it has none of SERIES."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        what = SERIES.get(name)
        if what is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if value == value and 0 <= value < 1e9:  # not NaN, not absurd
            found[what] = found.get(what, 0.0) + value
    if not found:
        return None
    usage = min(1.0, found.get("kv_usage", 0.0))
    return BackendLoad(int(found.get("running", 0)), int(found.get("waiting", 0)), usage)


class Scraper:
    """Reads the backend's `/metrics` every SCRAPE_S into `load`; `run()` is its loop (the engine owns the task)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.load: BackendLoad | None = None

    async def run(self) -> None:
        while await self.scrape():
            await asyncio.sleep(SCRAPE_S)

    async def scrape(self) -> bool:
        """One read; False once the backend shows it has no such metrics (not found, or none of SERIES)."""
        try:
            async with self.client.stream("GET", "/metrics", timeout=2.0) as response:
                if 400 <= response.status_code < 500:
                    return self._none(f"its /metrics answered {response.status_code}")
                body = b""
                async for data in response.aiter_bytes():
                    body += data
                    if len(body) > MAX_METRICS_BYTES:
                        return self._none(f"its /metrics is over {MAX_METRICS_BYTES} bytes")
        except httpx.HTTPError:
            self.load = None  # unknown while it does not answer; asked again
            return True
        if response.status_code != 200:
            self.load = None  # a 5xx: unknown for now; asked again
            return True
        self.load = parse(body.decode(errors="replace"))
        return self.load is not None or self._none("its /metrics has no vLLM or SGLang load series")

    def _none(self, why: str) -> bool:
        logger.info("the backend's own load is not read: %s; the load is this worker's requests there", why)
        self.load = None
        return False
