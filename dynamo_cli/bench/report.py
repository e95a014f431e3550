"""Reports of a benchmark run as data and files: JSON, CSV, per-request JSONL, PNG plots and comparisons.

Terminal rendering (rich) lives in `dynamo_cli/cli/bench.py`; this module only shapes and writes data.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import msgspec

from dynamo_cli.bench.agents import CallFigures
from dynamo_cli.bench.metrics import DEFINITIONS, LATENCY_METRICS, STAT_NAMES, RequestMetrics, Summary
from dynamo_cli.bench.tenants import TenantFigures
from dynamo_cli.errors import ConfigError

UNITS = {
    "ttft": "ms",
    "itl": "ms",
    "tpot": "ms",
    "e2e": "ms",
    "chunk_gap": "ms",
    "input_tokens": "tokens",
    "output_tokens": "tokens",
}

SCALARS = (
    ("num_requests", "requests", ""),
    ("num_completed", "completed", ""),
    ("num_failed", "failed", ""),
    ("duration_s", "duration", "s"),
    ("request_throughput", "request throughput", "req/s"),
    ("output_token_throughput", "output token throughput", "tok/s"),
    ("total_token_throughput", "total token throughput", "tok/s"),
    ("goodput", "goodput", "req/s"),
    ("good_fraction", "good fraction", ""),
)


def _clean(value: Any) -> Any:
    """NaN → None, recursively, so the JSON is valid."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def run_document(
    summary: Summary,
    info: dict[str, Any],
    calls: Sequence[CallFigures] = (),
    tenants: Sequence[TenantFigures] = (),
) -> dict[str, Any]:
    """The JSON document of one run: what was run, the summary, the agentic workload's figures by call (`agent`)
    and the multi-tenant workload's by tenant (`tenants`) where there are any, and the metric definitions."""
    document: dict[str, Any] = {"info": info, "summary": summary.to_dict()}
    if calls:
        document["agent"] = {"calls": [asdict(c) for c in calls]}
    if tenants:
        document["tenants"] = [asdict(t) for t in tenants]
    document["definitions"] = dict(DEFINITIONS)
    cleaned: dict[str, Any] = _clean(document)
    return cleaned


def write_json(path: str, document: dict[str, Any]) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(document), indent=2) + b"\n")


def write_csv(path: str, summaries: Sequence[tuple[str, Summary]]) -> None:
    """One row per (run, metric): the distribution stats, then one row per scalar figure."""
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["run", "metric", "unit", *STAT_NAMES, "count"])
        for label, summary in summaries:
            for name in LATENCY_METRICS:
                d = summary.latency[name]
                out.writerow([label, name, UNITS[name], *(_fmt(getattr(d, s)) for s in STAT_NAMES), d.count])
        out.writerow([])
        out.writerow(["run", "metric", "unit", "value"])
        for label, summary in summaries:
            for key, _, unit in SCALARS:
                out.writerow([label, key, unit, _fmt(getattr(summary, key))])


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def write_jsonl(path: str, metrics: Sequence[RequestMetrics], chunk_times: Sequence[Sequence[float]]) -> None:
    """One JSON line per measured request; times are seconds after the first request started."""
    origin = min((m.start for m in metrics), default=0.0)
    encoder = msgspec.json.Encoder()
    with open(path, "wb") as f:
        for m, times in zip(metrics, chunk_times, strict=True):
            row = {
                "start_s": m.start - origin,
                "end_s": m.end - origin,
                "ok": m.is_ok,
                "error": m.error,
                "ttft_ms": m.ttft,
                "itl_ms": m.itl,
                "tpot_ms": m.tpot,
                "e2e_ms": m.e2e,
                "input_tokens": m.input_tokens,
                "output_tokens": m.output_tokens,
                "output_tokens_from": "usage" if m.has_usage else "tokenizer",
                "status": m.status,
                "cached_tokens": m.cached_tokens,
                "retry_after_s": m.retry_after,
                "call": m.turn,
                "tenant": m.tenant,
                "chunk_ms": [round((t - m.start) * 1e3, 3) for t in times],
            }
            f.write(encoder.encode(row) + b"\n")


##### comparison #####


def flatten(document: dict[str, Any]) -> dict[str, float]:
    """The numeric figures of a run document's summary, keyed like `ttft.p50` or `request_throughput`."""
    summary = document.get("summary", document)
    flat: dict[str, float] = {}
    for key, value in summary.items():
        if key == "latency" and isinstance(value, dict):
            for metric, stats in value.items():
                for stat, number in stats.items():
                    if stat != "count" and isinstance(number, int | float):
                        flat[f"{metric}.{stat}"] = float(number)
        elif isinstance(value, int | float) and not isinstance(value, bool):
            flat[key] = float(value)
    return flat


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, float | None, float | None, float | None]]:
    """(metric, A, B, B/A) for every figure of either run; the ratio is None where A is 0 or missing."""
    fa, fb = flatten(a), flatten(b)
    rows = []
    for key in [*fa, *(k for k in fb if k not in fa)]:
        va, vb = fa.get(key), fb.get(key)
        ratio = vb / va if va not in (None, 0.0) and vb is not None else None
        rows.append((key, va, vb, ratio))
    return rows


def read_json(path: str) -> dict[str, Any]:
    try:
        document = msgspec.json.decode(Path(path).read_bytes())
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{path} is not JSON ({exc}); pass files written by `dyn bench --json`") from None
    if not isinstance(document, dict) or "summary" not in document:
        raise ConfigError(f"{path} has no 'summary'; pass files written by `dyn bench --json`")
    return document


##### plots #####


def require_matplotlib() -> None:
    """Fail before a run, not after it, when --plot cannot be honoured."""
    _pyplot()


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib, which is not installed; install it with: pip install 'dynamo-cli[plot]'"
        ) from None
    return plt


def plot_run(path: str, metrics: Sequence[RequestMetrics], chunk_times: Sequence[Sequence[float]]) -> None:
    """TTFT and ITL histograms, e2e latency over time, and output tokens/s per one-second bucket."""
    plt = _pyplot()
    ok = [m for m in metrics if m.is_ok]
    origin = min((m.start for m in metrics), default=0.0)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    axes[0][0].hist([m.ttft for m in ok if m.ttft is not None], bins=40)
    axes[0][0].set(title="TTFT", xlabel="ms", ylabel="requests")
    axes[0][1].hist([m.itl for m in ok if m.itl is not None], bins=40)
    axes[0][1].set(title="ITL (per request)", xlabel="ms", ylabel="requests")
    axes[1][0].scatter([m.start - origin for m in ok], [m.e2e for m in ok], s=6)
    axes[1][0].set(title="e2e latency over time", xlabel="request start (s)", ylabel="ms")
    buckets: dict[int, float] = {}
    for m, times in zip(metrics, chunk_times, strict=True):
        if m.is_ok and times:
            per_chunk = m.output_tokens / len(times)
            for t in times:
                second = int(t - origin)
                buckets[second] = buckets.get(second, 0) + per_chunk
    xs = sorted(buckets)
    axes[1][1].plot(xs, [buckets[x] for x in xs], marker=".")
    axes[1][1].set(title="output throughput", xlabel="time (s)", ylabel="tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(path: str, parameter: str, rows: Sequence[tuple[str, Summary]]) -> None:
    """Throughput against latency, one point per sweep value, labelled with the value."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for ax, metric in zip(axes, ("ttft", "itl"), strict=True):
        xs = [s.latency[metric].p50 for _, s in rows]
        ys = [s.output_token_throughput for _, s in rows]
        ax.plot(xs, ys, marker="o")
        for (label, _), x, y in zip(rows, xs, ys, strict=True):
            ax.annotate(f"{parameter}={label}", (x, y), fontsize=8)
        ax.set(title=f"output throughput vs {metric.upper()} p50", xlabel="ms", ylabel="tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
