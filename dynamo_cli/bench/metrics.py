"""Benchmark metrics: pure functions from request records to per-request figures and a run summary.

Definitions (printed with every report, see `DEFINITIONS`), chosen where the tools of this field disagree
(peers.md §B6) and stated so the numbers can be compared with theirs:

- TTFT: send → first SSE event with non-empty content (text or reasoning); role-only chunks do not count
  (AIPerf, SGLang, genai-perf; vLLM's bench counts the first `choices` event, even an empty one).
- ITL (per request): (e2e − TTFT) / (output tokens − 1) (AIPerf, genai-perf, GuideLLM; vLLM calls it TPOT).
- chunk gap: every gap between consecutive content events, kept separately (vLLM's and SGLang's "ITL");
  servers that put several tokens in one event make these larger than ITL.
- TPOT: e2e / output tokens, the first token included (GuideLLM's TPOT).
- e2e: send → last byte of the response.
- duration: last response end − first request start over the measured requests (AIPerf, genai-perf).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dynamo_cli.bench.http import RequestRecord
from dynamo_cli.errors import ConfigError

DEFINITIONS: tuple[tuple[str, str], ...] = (
    ("TTFT", "send → first SSE event with non-empty content (role-only chunks ignored)"),
    ("ITL", "per request: (e2e − TTFT) / (output tokens − 1); requests with 1 token have none"),
    ("chunk gap", "every gap between consecutive content events (vLLM/SGLang 'ITL'), reported separately"),
    ("TPOT", "per request: e2e / output tokens, first token included (GuideLLM); vLLM's TPOT is our ITL"),
    ("e2e", "send → last byte of the response"),
    ("duration", "last response end − first request start, measured requests only (warm-up excluded)"),
    ("throughput", "completed requests, output tokens, input + output tokens, each / duration"),
    (
        "tokens",
        "output: usage.completion_tokens, else the tokenizer; input: usage.prompt_tokens (chat "
        "template included), else the prompt's own length",
    ),
    ("goodput", "requests that succeeded and met every SLO / duration; failures count against it"),
    (
        "cache hit rate",
        "cached prompt tokens (usage.prompt_tokens_details.cached_tokens) / prompt tokens, over the completed "
        "requests that reported them",
    ),
    ("rejected", "answered 429: a failure, counted per tenant with its Retry-After, never retried"),
    ("stddev", "population standard deviation; percentiles interpolate linearly (numpy's default)"),
)

SLO_KEYS = ("ttft", "itl", "tpot", "e2e")


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency objectives in milliseconds; None means not constrained."""

    ttft: float | None = None
    itl: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    @property
    def is_empty(self) -> bool:
        return all(getattr(self, key) is None for key in SLO_KEYS)


def parse_slo(specs: Iterable[str]) -> Slo:
    """Parse `ttft=200 itl=25` (space or comma separated, ms; repeatable) into an Slo."""
    values: dict[str, float] = {}
    for spec in specs:
        for item in spec.replace(",", " ").split():
            key, sep, value = item.partition("=")
            key = key.strip().lower()
            if not sep or key not in SLO_KEYS:
                raise ConfigError(f"--slo {item!r}: expected KEY=MS with KEY one of {', '.join(SLO_KEYS)}")
            try:
                values[key] = float(value)
            except ValueError:
                raise ConfigError(f"--slo {item!r}: {value!r} is not a number of milliseconds") from None
    return Slo(**values)


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """The figures of one request; latencies in milliseconds, None where undefined."""

    is_ok: bool
    error: str | None
    start: float
    end: float
    ttft: float | None
    e2e: float
    itl: float | None
    tpot: float | None
    chunk_gaps: tuple[float, ...]
    input_tokens: int
    output_tokens: int
    has_usage: bool
    status: int = 200
    """HTTP status; 0 when no answer came."""
    cached_tokens: int | None = None
    """Prompt tokens the server found cached, when it said (`usage.prompt_tokens_details`)."""
    retry_after: float | None = None
    """Seconds a 429 or 503 asked to wait (`Retry-After`), when it said."""
    turn: int = 0
    """Index of the request in its conversation (an agent session's call), from 0."""
    tenant: str | None = None
    """The tenant that sent it (multi-tenant runs)."""


def request_metrics(record: RequestRecord, count_tokens: Callable[[str], int] | None) -> RequestMetrics:
    """Compute one request's figures; output tokens come from usage, else from `count_tokens`."""
    e2e = (record.end - record.start) * 1e3
    has_usage = record.completion_tokens is not None
    if has_usage:
        output_tokens = record.completion_tokens or 0
    else:
        output_tokens = count_tokens(record.text) if count_tokens else len(record.pieces)
    ok = record.is_ok and bool(record.chunk_times)
    error = record.error if record.error else (None if ok else "no content in the response")
    ttft = record.ttft * 1e3 if record.ttft is not None else None
    times = record.chunk_times
    gaps = tuple((b - a) * 1e3 for a, b in zip(times, times[1:], strict=False))
    itl = (e2e - ttft) / (output_tokens - 1) if ttft is not None and output_tokens > 1 else None
    return RequestMetrics(
        is_ok=ok,
        error=error,
        start=record.start,
        end=record.end,
        ttft=ttft,
        e2e=e2e,
        itl=itl,
        tpot=e2e / output_tokens if output_tokens > 0 else None,
        chunk_gaps=gaps,
        input_tokens=record.prompt_tokens if record.prompt_tokens is not None else record.input_tokens,
        output_tokens=output_tokens,
        has_usage=has_usage,
        status=record.status,
        cached_tokens=record.cached_tokens,
        retry_after=record.retry_after,
        turn=record.turn,
        tenant=record.tenant,
    )


def meets_slo(m: RequestMetrics, slo: Slo) -> bool:
    """A request is good when it succeeded and every set objective holds (an undefined ITL holds)."""
    if not m.is_ok:
        return False
    for key in SLO_KEYS:
        limit = getattr(slo, key)
        value = getattr(m, key)
        if limit is not None and value is not None and value > limit:
            return False
    return True


@dataclass(frozen=True, slots=True)
class Distribution:
    """Summary statistics of one metric's values."""

    count: int
    mean: float
    stddev: float
    min: float
    max: float
    p50: float
    p90: float
    p95: float
    p99: float


STAT_NAMES = ("mean", "stddev", "min", "p50", "p90", "p95", "p99", "max")


def percentile(ordered: Sequence[float], q: float) -> float:
    """The q-th percentile of sorted values, interpolating linearly between ranks (numpy 'linear')."""
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Iterable[float]) -> Distribution:
    """Mean, population stddev, min, max and p50/p90/p95/p99 of the values (NaN when empty)."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return Distribution(0, *([math.nan] * 8))
    mean = math.fsum(ordered) / n
    variance = math.fsum((v - mean) ** 2 for v in ordered) / n
    return Distribution(
        count=n,
        mean=mean,
        stddev=math.sqrt(variance),
        min=ordered[0],
        max=ordered[-1],
        p50=percentile(ordered, 50),
        p90=percentile(ordered, 90),
        p95=percentile(ordered, 95),
        p99=percentile(ordered, 99),
    )


@dataclass(frozen=True, slots=True)
class Summary:
    """A benchmark run's figures: latency distributions in ms, throughputs per second."""

    num_requests: int
    num_completed: int
    num_failed: int
    errors: dict[str, int]
    duration_s: float
    request_throughput: float
    output_token_throughput: float
    total_token_throughput: float
    goodput: float | None
    good_fraction: float | None
    slo: dict[str, float | None]
    output_tokens_source: str
    latency: dict[str, Distribution] = field(default_factory=dict)
    """ttft, itl, tpot, e2e, chunk_gap (ms) and input_tokens, output_tokens (counts)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


LATENCY_METRICS = ("ttft", "itl", "tpot", "e2e", "chunk_gap", "input_tokens", "output_tokens")


def summarize(metrics: Sequence[RequestMetrics], slo: Slo, tokens_fallback: str = "tokenizer") -> Summary:
    """Aggregate per-request metrics; failures are excluded from distributions but count for goodput."""
    ok = [m for m in metrics if m.is_ok]
    duration = (max(m.end for m in metrics) - min(m.start for m in metrics)) if metrics else 0.0
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    num_good = sum(1 for m in ok if meets_slo(m, slo))
    with_usage = sum(1 for m in ok if m.has_usage)
    source = "usage" if ok and with_usage == len(ok) else tokens_fallback if with_usage == 0 else "mixed"
    return Summary(
        num_requests=len(metrics),
        num_completed=len(ok),
        num_failed=len(metrics) - len(ok),
        errors=dict(Counter(m.error or "unknown" for m in metrics if not m.is_ok).most_common()),
        duration_s=duration,
        request_throughput=per_s(len(ok)),
        output_token_throughput=per_s(sum(m.output_tokens for m in ok)),
        total_token_throughput=per_s(sum(m.output_tokens + m.input_tokens for m in ok)),
        goodput=None if slo.is_empty else per_s(num_good),
        good_fraction=None if slo.is_empty or not metrics else num_good / len(metrics),
        slo={key: getattr(slo, key) for key in SLO_KEYS},
        output_tokens_source=source,
        latency=_distributions(ok),
    )


def _distributions(ok: Sequence[RequestMetrics]) -> dict[str, Distribution]:
    def values(name: str) -> list[float]:
        return [v for m in ok if (v := getattr(m, name)) is not None]

    result = {name: distribution(values(name)) for name in ("ttft", "itl", "tpot", "e2e")}
    result["chunk_gap"] = distribution(g for m in ok for g in m.chunk_gaps)
    result["input_tokens"] = distribution(float(m.input_tokens) for m in ok)
    result["output_tokens"] = distribution(float(m.output_tokens) for m in ok)
    return result
