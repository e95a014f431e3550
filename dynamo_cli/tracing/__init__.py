"""One trace per request across processes, and log lines that name their request (README: "Tracing and logs").

    traceparent.py  the W3C trace context a request carries: parsed, checked, carried on (pure)
    logs.py         each log line names the request and trace in scope; text or JSON lines
    spans.py        the spans of one process, exported with OTLP/HTTP (the only module importing OpenTelemetry)

Without `--otlp-endpoint` nothing of OpenTelemetry is imported: each process holds `None` for its `Tracing`,
and each place that would add a span costs one `is not None`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dynamo_cli.config import TelemetryConfig
from dynamo_cli.errors import ConfigError

if TYPE_CHECKING:
    from dynamo_cli.tracing.spans import Tracing

INSTALL = "pip install 'dynamo-cli[tracing]'"


def start_tracing(config: TelemetryConfig, service_name: str) -> Tracing | None:
    """The process's tracer, exporting as `service_name` (dyn-frontend, dyn-router, dyn-worker-ROLE); None
    without an OTLP endpoint. The caller calls its `shutdown()` on the way out (it flushes the last spans)."""
    if config.otlp_endpoint is None:
        return None
    return _tracing_class()(config, service_name)


def check_tracing(config: TelemetryConfig) -> None:
    """Fail now, with one ConfigError, where `--otlp-endpoint` is set and the SDK does not import: `dyn serve`
    checks before it starts its processes, so the error is said once, not by each of them."""
    if config.otlp_endpoint is not None:
        _tracing_class()


def _tracing_class() -> type[Tracing]:
    try:
        from dynamo_cli.tracing.spans import Tracing
    except ImportError as exc:
        if not (exc.name or "").startswith("opentelemetry"):
            raise
        raise ConfigError(
            f"--otlp-endpoint needs the OpenTelemetry SDK, which does not import here ({exc.name}); {INSTALL}"
        ) from None
    return Tracing
