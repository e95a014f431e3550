"""What a process shows of itself: its system server (probes and metrics), its traces and its log format.

One `TelemetryConfig` on the frontend's, each worker's and each `dyn router`'s config; the settings are shared
objects, so `dyn serve` shows each once and hands its value to every process it starts (a system port is a base:
`dyn serve` gives its children consecutive ports from it).
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamo_cli.errors import ConfigError
from dynamo_cli.settings import OBSERVABILITY, Setting, setting

LOG_FORMATS = ("text", "json")

SYSTEM_PORT = Setting(
    ("--system-port",),
    "DYN_SYSTEM_PORT",
    "Port of this process's /live, /health and /metrics (0: any free port; unset: none). dyn serve: the first"
    " of its children's consecutive ports.",
    OBSERVABILITY,
)
OTLP_ENDPOINT = Setting(
    ("--otlp-endpoint",),
    "DYN_OTLP_ENDPOINT",
    "Export traces with OTLP/HTTP to this URL (http://HOST:4318); unset: no tracing.",
    OBSERVABILITY,
)
TRACE_SAMPLE_RATIO = Setting(
    ("--trace-sample-ratio",),
    "DYN_TRACE_SAMPLE_RATIO",
    "Fraction of requests traced when the client sends no sampled traceparent (0..1).",
    OBSERVABILITY,
)
LOG_FORMAT = Setting(("--log-format",), "DYN_LOG_FORMAT", "text | json (one object per line)", OBSERVABILITY)


@dataclass(frozen=True, slots=True)
class TelemetryConfig:
    """The process's probes, metrics, traces and logs."""

    system_port: int | None = setting(None, SYSTEM_PORT)
    """Port of the system server (`/live`, `/health`, `/metrics`); 0: any free port; None: no system server."""
    otlp_endpoint: str | None = setting(None, OTLP_ENDPOINT)
    """OTLP/HTTP collector base URL (traces go to `{url}/v1/traces`); None: tracing off."""
    trace_sample_ratio: float = setting(1.0, TRACE_SAMPLE_RATIO)
    """Head sampling of requests that arrive without a sampled `traceparent`."""
    log_format: str = setting("text", LOG_FORMAT)
    """`text` or `json`; both carry the trace id and request id where a request is in scope."""

    def __post_init__(self) -> None:
        if self.system_port is not None and not 0 <= self.system_port <= 65535:
            raise ConfigError(f"--system-port must be 0..65535, got {self.system_port}")
        if not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise ConfigError(f"--trace-sample-ratio must be between 0 and 1, got {self.trace_sample_ratio}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"--log-format '{self.log_format}' is invalid; use one of: {', '.join(LOG_FORMATS)}")
        if self.otlp_endpoint is not None and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"--otlp-endpoint '{self.otlp_endpoint}' must be an http:// or https:// URL")
