"""The Grafana dashboard of a deployment, built with grafana-foundation-sdk (typed builders that check the
model as they build) and rendered to the JSON Grafana imports.

What it shows is data (`ROWS`: rows of panels of PromQL queries); every query names only series that the
metrics registries export (tests/monitoring/test_dashboard.py reads both). Panels filter on the dashboard's
`$model` variable (but the Batch API's, whose series have no model); the worker rows read each process's system
port (`dynamo_component_*`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model

UID = "dynamo-deployment"
"""The dashboard's uid: a re-import replaces the dashboard instead of adding a copy."""
TITLE = "Dynamo deployment"
MODEL = 'model=~"$model"'
"""The label matcher of every frontend query: the models picked in the `$model` variable."""
WINDOW = "$__rate_interval"
"""Grafana's rate window: at least four scrape intervals, whatever the zoom."""


@dataclass(frozen=True, slots=True)
class Query:
    """One PromQL query of a panel, drawn as one or more series."""

    expr: str
    """PromQL; `$model` and `$__rate_interval` are Grafana's to expand."""
    legend: str
    """Series name, templating labels as `{{model}}`."""


@dataclass(frozen=True, slots=True)
class PanelSpec:
    """A time-series panel."""

    title: str
    """Panel title."""
    unit: str
    """Grafana unit id of the y axis (`reqps`, `s`, `percent`, `short`, `GBs` ...)."""
    queries: tuple[Query, ...]
    """What it draws."""
    description: str = ""
    """Shown on the panel's (i) hover."""


def _select(metric: str, matcher: str) -> str:
    return f"{metric}{{{matcher}}}" if matcher else metric


def _sum_rate(metric: str, by: str, matcher: str = MODEL) -> str:
    return f"sum by ({by}) (rate({_select(metric, matcher)}[{WINDOW}]))"


def _quantiles(metric: str, by: str = "", matcher: str = MODEL) -> tuple[Query, ...]:
    """p50/p90/p99 of a histogram, per `by` labels (none: across everything selected)."""
    group = f"{by}, le" if by else "le"
    prefix = f"{{{{{by}}}}} " if by else ""
    return tuple(
        Query(f"histogram_quantile({q}, {_sum_rate(f'{metric}_bucket', group, matcher)})", f"{prefix}p{round(q * 100)}")
        for q in (0.5, 0.9, 0.99)
    )


def _mean(metric: str) -> str:
    return f"{_sum_rate(f'{metric}_sum', 'model')} / {_sum_rate(f'{metric}_count', 'model')}"


def _gauge(metric: str, legend: str, matcher: str = MODEL) -> Query:
    return Query(_select(metric, matcher), legend)


REQUESTS = (
    PanelSpec(
        "Request rate by status",
        "reqps",
        (Query(_sum_rate("dynamo_frontend_requests_total", "model, status"), "{{model}} {{status}}"),),
    ),
    PanelSpec(
        "In flight and queued",
        "short",
        (
            _gauge("dynamo_frontend_inflight_requests", "{{model}} in flight"),
            _gauge("dynamo_frontend_queued_requests", "{{model}} queued"),
        ),
        "Queued: requests waiting for a free worker (every worker over its busy threshold).",
    ),
    PanelSpec("Workers per model", "short", (_gauge("dynamo_frontend_workers", "{{model}}"),)),
    PanelSpec(
        "Output tokens/s",
        "short",
        (Query(_sum_rate("dynamo_frontend_output_tokens_total", "model"), "{{model}}"),),
    ),
)
LATENCY = (
    PanelSpec("Time to first token", "s", _quantiles("dynamo_frontend_time_to_first_token_seconds")),
    PanelSpec("Inter-token latency", "s", _quantiles("dynamo_frontend_inter_token_latency_seconds")),
    PanelSpec("Request duration", "s", _quantiles("dynamo_frontend_request_duration_seconds")),
    PanelSpec(
        "Queue wait",
        "s",
        _quantiles("dynamo_frontend_queue_wait_seconds"),
        "Of the requests that waited; one near --router-queue-timeout is answered 503.",
    ),
)
TOKENS = (
    PanelSpec(
        "Input / output sequence length (mean)",
        "short",
        (
            Query(_mean("dynamo_frontend_input_sequence_tokens"), "{{model}} ISL"),
            Query(_mean("dynamo_frontend_output_sequence_tokens"), "{{model}} OSL"),
            Query(_mean("dynamo_frontend_cached_tokens"), "{{model}} cached"),
        ),
    ),
    PanelSpec("Input sequence length", "short", _quantiles("dynamo_frontend_input_sequence_tokens")),
    PanelSpec("Output sequence length", "short", _quantiles("dynamo_frontend_output_sequence_tokens")),
)
WORKERS = (
    PanelSpec(
        "KV cache usage per worker",
        "percentunit",
        (
            Query(
                f"{_select('dynamo_frontend_worker_active_decode_blocks', MODEL)}"
                f" / {_select('dynamo_frontend_worker_total_blocks', MODEL)}",
                "{{worker_type}} {{worker_id}}",
            ),
        ),
        "The frontend's view, from each worker's last load report.",
    ),
    PanelSpec(
        "Running / waiting per worker",
        "short",
        (
            _gauge("dynamo_frontend_worker_running_requests", "{{worker_id}} running"),
            _gauge("dynamo_frontend_worker_waiting_requests", "{{worker_id}} waiting"),
            _gauge("dynamo_frontend_worker_inflight_requests", "{{worker_id}} streams open"),
        ),
        "Running and waiting: the worker's scheduler; streams open: this frontend's on the worker.",
    ),
    PanelSpec(
        "LoRA adapters per worker",
        "short",
        (
            _gauge("dynamo_frontend_worker_lora_adapters_loaded", "{{worker_id}} loaded"),
            Query(
                f"deriv({_select('dynamo_frontend_worker_lora_loads', MODEL)}[{WINDOW}]) * 60",
                "{{worker_id}} loads/min",
            ),
        ),
        "Adapters loaded now, and loads per minute (reloads after an eviction: --max-loras too small, or routing "
        "that ignores where adapters are loaded).",
    ),
    PanelSpec(
        "KV cache usage per worker (system ports)",
        "percentunit",
        (_gauge("dynamo_component_kvstats_gpu_cache_usage_percent", "{{dynamo_component}} {{instance}}"),),
        "Read from each worker's own /metrics (--system-port).",
    ),
    PanelSpec(
        "Running / waiting per worker (system ports)",
        "short",
        (
            _gauge("dynamo_component_running_requests", "{{instance}} running"),
            _gauge("dynamo_component_waiting_requests", "{{instance}} waiting"),
        ),
    ),
    PanelSpec(
        "KV blocks per worker (system ports)",
        "short",
        (
            _gauge("dynamo_component_kvstats_active_blocks", "{{instance}} active"),
            _gauge("dynamo_component_kvstats_total_blocks", "{{instance}} total"),
        ),
    ),
)
COMPONENTS = (
    PanelSpec(
        "Component request rate",
        "reqps",
        (
            Query(
                _sum_rate("dynamo_component_requests_total", "instance, dynamo_component, dynamo_endpoint", ""),
                "{{dynamo_component}}/{{dynamo_endpoint}} {{instance}}",
            ),
        ),
        "Requests each worker and router served on its request-plane endpoints.",
    ),
    PanelSpec(
        "Component request duration",
        "s",
        _quantiles("dynamo_component_request_duration_seconds", "dynamo_component", ""),
    ),
    PanelSpec(
        "Component in flight",
        "short",
        (_gauge("dynamo_component_inflight_requests", "{{dynamo_component}} {{instance}}", ""),),
    ),
    PanelSpec(
        "Component errors and cancellations",
        "reqps",
        (
            Query(_sum_rate("dynamo_component_errors_total", "instance", ""), "{{instance}} errors"),
            Query(_sum_rate("dynamo_component_cancellation_total", "instance", ""), "{{instance}} cancelled"),
        ),
    ),
)
DISAGGREGATION = (
    PanelSpec(
        "Disaggregation outcomes",
        "reqps",
        (Query(_sum_rate("dynamo_frontend_disagg_decisions_total", "outcome"), "{{outcome}}"),),
        "Where prompts were prefilled: remote, or local and why (short, prefill busy, cheaper, no prefill worker, "
        "fallback after a failed pull).",
    ),
    PanelSpec(
        "KV transfer GB/s",
        "GBs",
        (
            Query(f"{_sum_rate('dynamo_frontend_kv_transfer_bytes_total', 'backend')} / 1e9", "{{backend}} mean"),
            _gauge("dynamo_frontend_kv_transfer_gbps", "{{model}} {{backend}} last pull"),
        ),
    ),
    PanelSpec("KV transfer time", "s", _quantiles("dynamo_frontend_kv_transfer_seconds", "backend")),
)
FAULTS = (
    PanelSpec(
        "Migrations",
        "short",
        (
            Query(
                f"sum by (migration_type) (increase(dynamo_frontend_model_migration_total{{{MODEL}}}[{WINDOW}]))",
                "{{migration_type}}",
            ),
        ),
        "Streams moved to another worker after theirs failed or stalled.",
    ),
    PanelSpec(
        "Worker stalls and recoveries",
        "short",
        (
            Query(
                f"sum by (worker_id, reason) (increase(dynamo_frontend_worker_stalls_total{{{MODEL}}}[{WINDOW}]))",
                "{{worker_id}} stalled ({{reason}})",
            ),
            Query(
                f"sum by (worker_id) (increase(dynamo_frontend_worker_recoveries_total{{{MODEL}}}[{WINDOW}]))",
                "{{worker_id}} recovered",
            ),
        ),
    ),
    PanelSpec(
        "Worker restarts and failed KV pulls",
        "short",
        (
            Query(f"increase(dynamo_frontend_worker_restarts_total[{WINDOW}])", "restarts"),
            Query(
                f'sum(increase(dynamo_frontend_kv_transfer_seconds_count{{{MODEL}, backend="local"}}[{WINDOW}]))',
                "failed KV pulls",
            ),
        ),
    ),
    PanelSpec(
        "Disconnected clients and cancellations",
        "reqps",
        (
            Query(_sum_rate("dynamo_frontend_disconnected_clients_total", "model"), "{{model}} disconnected"),
            Query(_sum_rate("dynamo_frontend_model_cancellation_total", "model"), "{{model}} cancelled"),
        ),
    ),
)
BATCHES = (
    PanelSpec(
        "Batch lines by state",
        "short",
        (Query("max by (state) (dynamo_frontend_batch_lines)", "{{state}}"),),
        "Lines of every batch: pending, done, failed. Read from the batch database at each scrape, so the "
        "frontends sharing one report the same figures (hence max, not sum).",
    ),
    PanelSpec(
        "Batch tokens/s",
        "short",
        (Query(f"max by (kind) (rate(dynamo_frontend_batch_tokens_total[{WINDOW}]))", "{{kind}}"),),
        "Prompt and completion tokens of the batch lines that finished (max over frontends, as above).",
    ),
    PanelSpec(
        "Batch lines in flight",
        "short",
        (_gauge("dynamo_frontend_batch_inflight", "{{instance}}", ""),),
        "Lines each frontend's batch runner has running on the workers (at most --batch-max-inflight).",
    ),
)
ROWS = (
    ("Requests", REQUESTS),
    ("Latency", LATENCY),
    ("Tokens", TOKENS),
    ("Workers", WORKERS),
    ("Components (system ports)", COMPONENTS),
    ("Disaggregation and KV transfer", DISAGGREGATION),
    ("Faults", FAULTS),
    ("Batch API", BATCHES),  # last: the panels above keep their ids (links to a panel name its id)
)
"""The dashboard, top to bottom."""

_DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")


def build_dashboard() -> model.Dashboard:
    """The dashboard model: a Prometheus datasource variable, a `$model` variable, then `ROWS`."""
    builder = (
        dashboard_builders.Dashboard(TITLE)
        .uid(UID)
        .tags(["dynamo", "llm-inference"])
        .refresh("10s")
        .time("now-30m", "now")
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .with_variable(dashboard_builders.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(
            dashboard_builders.QueryVariable("model")
            .label("Model")
            .datasource(_DATASOURCE)
            .query("label_values(dynamo_frontend_workers, model)")
            .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
    )
    panel_id = 0
    for title, panels in ROWS:
        panel_id += 1
        builder = builder.with_row(dashboard_builders.Row(title).id(panel_id))
        for spec in panels:
            panel_id += 1
            builder = builder.with_panel(_panel(spec).id(panel_id))
    return builder.build()


def render_dashboard() -> str:
    """The dashboard JSON Grafana imports (Dashboards → New → Import), keys sorted so diffs stay small."""
    return json.dumps(build_dashboard(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def _panel(spec: PanelSpec) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(spec.title)
        .datasource(_DATASOURCE)
        .unit(spec.unit)
        .span(8)
        .height(8)
        .legend(common_builders.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST).show_legend(True))
    )
    if spec.description:
        panel = panel.description(spec.description)
    for ref, query in zip("ABCDEFGH", spec.queries, strict=False):
        panel = panel.with_target(prometheus.Dataquery().expr(query.expr).legend_format(query.legend).ref_id(ref))
    return panel
