"""What a request-plane server counts per endpoint, as plain integers on its own loop (read at scrape time)."""

from __future__ import annotations

import bisect

DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Upper bounds (s) of the request-duration histogram each endpoint keeps (`EndpointStats`)."""


class EndpointStats:
    """One endpoint's counts, kept by its server as plain integers (read by the system server's /metrics)."""

    __slots__ = (
        "cancelled",
        "duration_counts",
        "duration_sum",
        "errors",
        "inflight",
        "request_bytes",
        "requests",
        "response_bytes",
    )

    def __init__(self) -> None:
        self.requests = self.inflight = self.errors = self.cancelled = 0
        self.request_bytes = self.response_bytes = 0
        self.duration_counts = [0] * (len(DURATION_BUCKETS) + 1)
        """Requests per duration bucket (the last: over every bound)."""
        self.duration_sum = 0.0

    def ended(self, seconds: float) -> None:
        self.inflight -= 1
        self.duration_counts[bisect.bisect_left(DURATION_BUCKETS, seconds)] += 1
        self.duration_sum += seconds
