"""The backend's own load, read from its Prometheus `/metrics` where it has one (vLLM's `vllm:*`, SGLang's
`sglang:*`): requests running and waiting there, from every client, and how full its KV cache is. A backend with no
such series is not asked again. The first read also gives its KV cache's shape where it says it (vLLM's
`vllm:cache_config_info` labels: `block_size`, `num_gpu_blocks`)."""

from __future__ import annotations

import asyncio
import logging
import re
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


@dataclass(frozen=True, slots=True)
class CacheShape:
    """The backend's KV cache as its `/metrics` states it."""

    block_size: int | None = None
    num_gpu_blocks: int | None = None


_CACHE_INFO = "vllm:cache_config_info{"
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def cache_shape(text: str) -> CacheShape:
    """The block size and block count in a Prometheus text body (vLLM's `vllm:cache_config_info`); None where unsaid."""
    line = next((line for line in text.splitlines() if line.startswith(_CACHE_INFO)), "")
    labels = dict(_LABEL.findall(line[: line.rfind("}")]))
    return CacheShape(_count(labels.get("block_size")), _count(labels.get("num_gpu_blocks")))


def _count(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() and 0 < int(value) < 1 << 31 else None


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
        self.shape = CacheShape()
        """The backend's KV cache, from the first read that states it."""

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
        text = body.decode(errors="replace")
        if self.shape == CacheShape():
            self.shape = cache_shape(text)
        self.load = parse(text)
        return self.load is not None or self._none("its /metrics has no vLLM or SGLang load series")

    def _none(self, why: str) -> bool:
        logger.info("the backend's own load is not read: %s; the load is this worker's requests there", why)
        self.load = None
        return False
