"""`dyn top URL`: a live terminal view of a deployment, read from its frontend's /metrics (dynamo_cli/top/)."""

from __future__ import annotations

import contextlib
from typing import Annotated

import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from dynamo_cli.errors import ConfigError
from dynamo_cli.top.frame import Latency, ModelRow, TopFrame
from dynamo_cli.top.scrape import MetricsSource, MetricsUnreadable, frame_once, frames

_COLUMNS = ("worker", "role", "running", "waiting", "KV used", "in flight", "requests", "req/s", "KV routing")


def command(
    url: Annotated[str, typer.Argument(help="The frontend, http://HOST:PORT.")],
    interval: Annotated[float, typer.Option("--interval", help="Seconds between refreshes.")] = 2.0,
    once: Annotated[
        bool, typer.Option("--once", help="Print one frame (two readings --interval apart), exit.")
    ] = False,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key", envvar="DYN_TOP_API_KEY", help="Key, when /metrics needs one (--metrics-require-key)."
        ),
    ] = None,
) -> None:
    """Per worker: running, waiting, KV usage, req/s; per model: req/s, TTFT and ITL p50/p99, queue, disaggregation."""
    if not interval > 0:
        raise ConfigError(f"--interval ({interval}) must be a positive number of seconds")
    source = MetricsSource(url, api_key)
    console = Console()
    try:
        if once:
            console.print(render(frame_once(source, interval), source.url, interval))
            return
        with contextlib.suppress(KeyboardInterrupt):
            _live(console, source, interval)
    finally:
        source.close()


def _live(console: Console, source: MetricsSource, interval: float) -> None:
    last: TopFrame | None = None
    with Live(Text(f"reading {source.url} ..."), console=console, auto_refresh=False, screen=False) as live:
        for item in frames(source, interval):
            error = str(item) if isinstance(item, MetricsUnreadable) else None
            last = item if isinstance(item, TopFrame) else last
            live.update(render(last, source.url, interval, error), refresh=True)


def render(frame: TopFrame | None, url: str, interval: float, error: str | None = None) -> RenderableType:
    """One screen: a header line, then each model's figures and its workers' table."""
    header = Text.from_markup(f"[bold]dyn top[/] {escape(url)}  every {interval:g} s")
    if frame is not None:
        header.append(f"\nworker stalls {frame.num_stalls:.0f}  ·  worker restarts {frame.num_restarts:.0f}")
    parts: list[RenderableType] = [header]
    if error is not None:
        parts.append(Text.from_markup(f"[bold red]error:[/] {escape(error)} (retrying)"))
    if frame is None:
        return Group(*parts)
    if not frame.models:
        parts.append(Text("no model registered"))
    has_rates = frame.interval_s > 0
    for model in frame.models:
        parts += [Text(""), _summary(model, has_rates), _workers(model, has_rates)]
    if frame.tenants:
        parts += [Text(""), _tenants(frame, has_rates)]
    return Group(*parts)


def _tenants(frame: TopFrame, has_rates: bool) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("tenant", "req/s", "tokens/s", "queue wait", "429s"):
        table.add_column(column, justify="left" if column == "tenant" else "right", overflow="fold")
    for t in frame.tenants:
        since = " (since start)" if t.queue_wait.is_since_start else ""
        wait = _latency(t.queue_wait) + since
        tokens = _rate(t.tokens_per_s, has_rates)
        table.add_row(t.name, _rate(t.requests_per_s, has_rates), tokens, wait, f"{t.num_rejections:.0f}")
    return table


def _summary(model: ModelRow, has_rates: bool) -> Text:
    disagg = ", ".join(f"{outcome} {n:.0f}" for outcome, n in sorted(model.disagg.items())) or "-"
    gbps = "-" if model.transfer_gbps is None else f"{model.transfer_gbps:.2f}"
    gbps += " (since start)" if model.is_transfer_since_start else ""
    since = "  (since start)" if model.ttft.is_since_start or model.itl.is_since_start else ""
    line = Text.from_markup(f"[bold cyan]{escape(model.name)}[/]  ")
    line.append(
        f"req/s {_rate(model.requests_per_s, has_rates)}  ·  queued {model.num_queued:.0f}  ·  "
        f"in flight {model.num_inflight:.0f}  ·  migrations {model.num_migrations:.0f}\n"
        f"  TTFT {_latency(model.ttft)}   ITL {_latency(model.itl)}{since}\n"
        f"  disaggregation {disagg}  ·  KV transfer GB/s {gbps}  ·  prefix hits {_hits(model.prefix_hits)}"
    )
    return line


def _hits(hits: tuple[float, float] | None) -> str:
    """Achieved of reachable, since start: `41% (reachable 55%)`."""
    return "-" if hits is None else f"{hits[0]:.0%} (reachable {hits[1]:.0%})"


def _workers(model: ModelRow, has_rates: bool) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in _COLUMNS:
        table.add_column(column, justify="left" if column in ("worker", "role") else "right", overflow="fold")
    for w in model.workers:
        kv = "-" if w.kv_usage is None else f"{w.kv_usage:.0%}"
        table.add_row(
            w.worker_id,
            w.role,
            f"{w.num_running:.0f}",
            f"{w.num_waiting:.0f}",
            kv,
            f"{w.num_inflight:.0f}",
            f"{w.num_requests:.0f}",
            _rate(w.requests_per_s, has_rates),
            w.routing,
        )
    return table


def _rate(value: float, has_rates: bool) -> str:
    return f"{value:.1f}" if has_rates else "-"


def _latency(latency: Latency) -> str:
    if latency.p50 is None or latency.p99 is None:
        return "p50 - p99 -"
    return f"p50 {_ms(latency.p50)}  p99 {_ms(latency.p99)}"


def _ms(seconds: float) -> str:
    ms = seconds * 1000
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms"
