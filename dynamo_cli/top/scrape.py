"""Reading a frontend's /metrics over HTTP for `dyn top`: one GET per refresh, with a timeout, and the
frames made from consecutive readings."""

from __future__ import annotations

import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx

from dynamo_cli.errors import ConfigError, DynError
from dynamo_cli.top.frame import TopFrame, frame_between
from dynamo_cli.top.snapshot import MetricsSnapshot, parse_snapshot

SCRAPE_TIMEOUT_S = 5.0


class MetricsUnreadable(DynError):
    """The frontend's /metrics did not answer, refused us, or is not a dyn frontend's."""

    def __init__(self, url: str, cause: str) -> None:
        self.url = url
        self.cause = cause
        super().__init__(f"cannot read {url}: {cause}")


def metrics_url(url: str) -> str:
    """`http://host:port` (or its `/metrics`) → the /metrics URL; ConfigError for anything but http(s)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"'{url}' is not a frontend URL; give it as http://HOST:PORT (or https://)")
    path = parts.path.rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{path if path.endswith('/metrics') else path + '/metrics'}"


class MetricsSource:
    """One frontend's /metrics, read on demand; `close()` when done."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = SCRAPE_TIMEOUT_S) -> None:
        self.url = metrics_url(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(headers=headers, timeout=timeout)

    def read(self) -> MetricsSnapshot:
        """A snapshot now; MetricsUnreadable when the frontend does not answer with its metrics."""
        try:
            response = self._client.get(self.url)
        except httpx.HTTPError as exc:
            raise MetricsUnreadable(self.url, f"{type(exc).__name__}: {exc}".rstrip(": ")) from None
        if response.status_code != 200:
            hint = "; pass --api-key" if response.status_code in (401, 403) else ""
            raise MetricsUnreadable(self.url, f"HTTP {response.status_code}{hint}")
        try:
            return parse_snapshot(response.text, time.monotonic())
        except ValueError as exc:
            raise MetricsUnreadable(self.url, f"not Prometheus metrics of a dyn frontend ({exc})") from None

    def close(self) -> None:
        self._client.close()


def frame_once(source: MetricsSource, interval: float) -> TopFrame:
    """Two readings `interval` seconds apart, as one frame (for `--once`); MetricsUnreadable if either fails."""
    before = source.read()
    time.sleep(interval)
    return frame_between(before, source.read())


def frames(source: MetricsSource, interval: float) -> Iterator[TopFrame | MetricsUnreadable]:
    """A frame every `interval` seconds, forever; a failed reading yields its error and the next one tries
    again (rates then span the gap from the last good reading)."""
    before: MetricsSnapshot | None = None
    while True:
        started = time.monotonic()
        try:
            now = source.read()
        except MetricsUnreadable as exc:
            yield exc
        else:
            yield frame_between(before, now)
            before = now
        time.sleep(max(0.0, interval - (time.monotonic() - started)))
