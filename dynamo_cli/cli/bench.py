"""`dyn bench`: load-test any OpenAI-compatible endpoint and report TTFT, ITL, throughput and goodput."""

from __future__ import annotations

import inspect
import math
import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dynamo_cli.bench import report
from dynamo_cli.bench.agents import CallFigures
from dynamo_cli.bench.http import RequestRecord
from dynamo_cli.bench.load import LoadConfig, parse_model_mix, run_async
from dynamo_cli.bench.metrics import DEFINITIONS, LATENCY_METRICS, STAT_NAMES, Summary
from dynamo_cli.bench.session import BenchConfig, BenchResult, run_bench
from dynamo_cli.bench.tenants import TenantFigures
from dynamo_cli.bench.workload import read_trace
from dynamo_cli.cli import settings

app = typer.Typer(help="Benchmark an OpenAI-compatible endpoint (TTFT, ITL, throughput, goodput).")

KNOBS = settings.knobs(BenchConfig)
"""The run's settings, declared on BenchConfig, LoadConfig and WorkloadConfig."""


def _output(name: str, flag: str, help: str) -> inspect.Parameter:
    return settings.option(name, Annotated[str | None, typer.Option(flag, help=help)], None)


OUTPUTS = [
    settings.option("ctx", typer.Context, inspect.Parameter.empty),
    _output("json_path", "--json", "Write the summary as JSON."),
    _output("csv_path", "--csv", "Write the summary as CSV."),
    _output("jsonl_path", "--jsonl", "Write one JSON line per request."),
    _output("plot", "--plot", "Write plots to this PNG (needs matplotlib)."),
    settings.option(
        "progress", Annotated[bool, typer.Option("--progress/--no-progress", help="Show live progress.")], True
    ),
]
"""Where the results go (and the typer context: `dyn bench compare` is a subcommand)."""


def _bench(**values: Any) -> None:
    """Run a benchmark against --url and print the summary."""
    if values["ctx"].invoked_subcommand is not None:
        return
    trace, duration = values["trace"], values["duration"]
    num_requests = values["num_requests"]
    if trace and not (num_requests or duration):
        num_requests = len(read_trace(trace))  # replay the whole trace
    elif values["agent_sessions"] and not (num_requests or duration):
        num_requests = values["agent_sessions"] * (values["agent_calls"] or 1)  # every call of every session
    given: dict[tuple[type, str], Any] = {
        (LoadConfig, "num_requests"): num_requests if num_requests or duration else 100
    }
    config = settings.build(BenchConfig, values, KNOBS, given)
    if config.model_mix is not None:
        parse_model_mix([config.model or "m"], config.model_mix)  # a bad spec fails here, before any connection
    if values["plot"]:
        report.require_matplotlib()
    result = _run(config, values["progress"])
    _print(result, config)
    _write(result, values["json_path"], values["csv_path"], values["jsonl_path"], values["plot"])


bench = app.callback(invoke_without_command=True)(settings.command(_bench, KNOBS, OUTPUTS))


@app.command()
def compare(
    a: Annotated[str, typer.Argument(help="Baseline JSON from `dyn bench --json`.")],
    b: Annotated[str, typer.Argument(help="Candidate JSON.")],
) -> None:
    """Print every metric of two runs and the ratio B/A."""
    rows = report.compare(report.read_json(a), report.read_json(b))
    table = Table(title=f"B/A  (A = {a}, B = {b})")
    for column in ("metric", "A", "B", "B/A"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for name, va, vb, ratio in rows:
        table.add_row(name, _num(va), _num(vb), "" if ratio is None else f"{ratio:.3f}")
    _console().print(table)


##### running with progress #####


class _Live:
    """Running counts shown on the progress bar: done, failed, mean TTFT, output tokens/s."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress = progress
        self.task: Any = None
        self._reset()

    def _reset(self) -> None:
        self.done = self.failed = 0
        self.ttft_sum = 0.0
        self.pieces = 0
        self.started = time.perf_counter()

    def phase(self, label: str, load: LoadConfig) -> None:
        if self.progress is None:
            return
        if self.task is not None:
            self.progress.remove_task(self.task)
        self._reset()
        total = load.num_requests if load.num_requests else None
        name = f"sweep {label}" if label else "bench"
        self.task = self.progress.add_task(name, total=total, stats="")

    def record(self, record: RequestRecord) -> None:
        self.done += 1
        if record.error is not None:
            self.failed += 1
        elif record.ttft is not None:
            self.ttft_sum += record.ttft
            self.pieces += record.completion_tokens or len(record.pieces)
        if self.progress is not None and self.task is not None:
            ok = self.done - self.failed
            mean_ttft = self.ttft_sum / ok * 1e3 if ok else 0.0
            rate = self.pieces / max(time.perf_counter() - self.started, 1e-9)
            stats = f"TTFT avg {mean_ttft:7.1f} ms · {rate:8.1f} out tok/s · failed {self.failed}"
            self.progress.update(self.task, completed=self.done, stats=stats)


def _run(config: BenchConfig, show: bool) -> BenchResult:
    console = Console(stderr=True)
    if not show:
        return run_async(run_bench(config))  # type: ignore[no-any-return]
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[stats]}"),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        live = _Live(progress)
        return run_async(run_bench(config, live.record, live.phase))  # type: ignore[no-any-return]


##### printing #####


def _num(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def _summary_table(summary: Summary, title: str) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    for stat in STAT_NAMES:
        table.add_column(stat, justify="right")
    for name in LATENCY_METRICS:
        d = summary.latency[name]
        unit = report.UNITS[name]
        table.add_row(f"{name} ({unit})", *(_num(getattr(d, s)) for s in STAT_NAMES))
    return table


def _scalars_table(summary: Summary) -> Table:
    table = Table(show_header=False, box=None)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, label, unit in report.SCALARS:
        value = getattr(summary, key)
        if value is not None:
            table.add_row(label, f"{_num(value, 3 if isinstance(value, float) else 0)} {unit}".strip())
    return table


def _console() -> Console:
    console = Console()
    return console if console.is_terminal else Console(width=140)  # files and pipes: no wrapped tables


def _print(result: BenchResult, config: BenchConfig) -> None:
    console = _console()
    info = result.info
    console.print(f"[bold]{info['model']}[/] at {info['url']} ({info['endpoint']}); prompts: {info['tokenizer']}")
    if config.sweep is not None:
        console.print(_sweep_table(config.sweep[0], result))
    for run in result.runs:
        s = run.summary
        title = f"{config.sweep[0]}={run.label}" if config.sweep else "latency"
        if config.sweep is None:
            console.print(_summary_table(s, title))
            console.print(_scalars_table(s))
        if run.calls:
            console.print(_calls_table(run.calls))
        if run.tenants:
            console.print(_tenants_table(run.tenants))
        console.print(f"output tokens from: {s.output_tokens_source}" + (f"  ({title})" if config.sweep else ""))
        for error, count in s.errors.items():
            console.print(f"[red]{count} failed:[/] {error}", highlight=False)
    console.print("[dim]definitions:[/]")
    for name, text in DEFINITIONS:
        console.print(f"[dim]  {name}: {text}[/]", highlight=False)


def _calls_table(calls: list[CallFigures]) -> Table:
    table = Table(title="agent sessions, by call")
    for column in ("calls", "requests", "completed", "TTFT p50 (ms)", "TTFT p90 (ms)", "cache hit rate"):
        table.add_column(column, justify="left" if column == "calls" else "right")
    for c in calls:
        hit = "–" if c.cache_hit_rate is None else f"{c.cache_hit_rate:.1%}"
        table.add_row(c.calls, str(c.num_requests), str(c.num_completed), _num(c.ttft_p50), _num(c.ttft_p90), hit)
    return table


_TENANT_COLUMNS = (
    "tenant",
    "class",
    "sent",
    "ok",
    "429",
    "errors",
    "TTFT p50",
    "TTFT p90",
    "TTFT p99",
    "e2e p50",
    "e2e p99",
    "out tok/s",
    "share/weight",
    "retry-after",
)


def _tenants_table(tenants: list[TenantFigures]) -> Table:
    table = Table(title="tenants (ms; share of output tokens / share of weight; the longest Retry-After of 429s)")
    for column in _TENANT_COLUMNS:
        table.add_column(column, justify="left" if column in ("tenant", "class") else "right")
    for t in tenants:
        share = "–" if t.output_share is None else f"{t.output_share:.0%}"
        counts = (t.num_sent, t.num_completed, t.num_rejected, t.num_errors)
        latencies = (t.ttft_p50, t.ttft_p90, t.ttft_p99, t.e2e_p50, t.e2e_p99, t.output_token_throughput)
        wait = "–" if t.retry_after_max is None else f"{t.retry_after_max:g} s"
        cells = (t.name, t.priority_class or "–", *map(str, counts), *(_num(v, 1) for v in latencies))
        table.add_row(*cells, f"{share}/{t.weight_share:.0%}", wait)
    return table


def _sweep_table(parameter: str, result: BenchResult) -> Table:
    table = Table(title=f"sweep over {parameter}")
    columns = (
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "e2e p50",
        "goodput",
        "failed",
    )
    table.add_column(parameter, justify="right")
    for column in columns:
        table.add_column(column, justify="right")
    for run in result.runs:
        s, lat = run.summary, run.summary.latency
        figures = (
            s.request_throughput,
            s.output_token_throughput,
            lat["ttft"].p50,
            lat["ttft"].p99,
            lat["itl"].p50,
            lat["itl"].p99,
            lat["e2e"].p50,
            s.goodput,
        )
        table.add_row(run.label, *(_num(f) for f in figures), str(s.num_failed))
    return table


def _write(
    result: BenchResult, json_path: str | None, csv_path: str | None, jsonl_path: str | None, plot: str | None
) -> None:
    runs = result.runs
    if json_path:
        if len(runs) == 1:
            document = report.run_document(runs[0].summary, result.info, runs[0].calls, runs[0].tenants)
        else:
            document = {
                "info": result.info,
                "sweep": [{"label": r.label, **report.run_document(r.summary, {})} for r in runs],
            }
        report.write_json(json_path, document)
    if csv_path:
        report.write_csv(csv_path, [(r.label, r.summary) for r in runs])
    if jsonl_path:
        report.write_jsonl(jsonl_path, [m for r in runs for m in r.metrics], [t for r in runs for t in r.chunk_times])
    if plot:
        if len(runs) == 1:
            report.plot_run(plot, runs[0].metrics, runs[0].chunk_times)
        else:
            report.plot_sweep(plot, result.info["sweep"][0], [(r.label, r.summary) for r in runs])
