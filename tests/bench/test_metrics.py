"""Metric arithmetic on hand-built records: exact values, no sockets."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dynamo_cli.bench.http import RequestRecord
from dynamo_cli.bench.metrics import Slo, distribution, parse_slo, request_metrics, summarize
from dynamo_cli.errors import ConfigError


def _record(start: float, ttft: float, gap: float, tokens: int, usage: bool = True) -> RequestRecord:
    times = [start + ttft + i * gap for i in range(tokens)]
    return RequestRecord(
        start=start,
        end=times[-1],
        chunk_times=times,
        pieces=["x"] * tokens,
        completion_tokens=tokens if usage else None,
        input_tokens=100,
    )


def test_ttft_itl_tpot_and_e2e_follow_their_definitions() -> None:
    m = request_metrics(_record(start=10.0, ttft=0.050, gap=0.010, tokens=11), None)
    assert m.ttft == pytest.approx(50.0)
    assert m.e2e == pytest.approx(150.0)
    assert m.itl == pytest.approx((150.0 - 50.0) / 10)  # (e2e − TTFT)/(tokens − 1)
    assert m.tpot == pytest.approx(150.0 / 11)  # e2e / tokens, first token included
    assert m.chunk_gaps == pytest.approx([10.0] * 10)


def test_a_role_only_first_event_does_not_count_for_ttft() -> None:
    record = _record(start=0.0, ttft=0.2, gap=0.01, tokens=3)
    record.first_event = 0.001  # an empty role chunk arrived at once
    assert request_metrics(record, None).ttft == pytest.approx(200.0)


def test_output_tokens_come_from_the_tokenizer_when_the_server_sends_no_usage() -> None:
    record = _record(start=0.0, ttft=0.1, gap=0.01, tokens=4, usage=False)
    record.pieces = ["one two", " three", " four", " five six"]
    m = request_metrics(record, lambda text: len(text.split()))
    assert (m.output_tokens, m.has_usage) == (6, False)
    assert summarize([m], Slo(), "tokenizer").output_tokens_source == "tokenizer"


def test_distribution_matches_numpy_percentiles_and_population_stddev() -> None:
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0, 5.0]
    d = distribution(values)
    for q in (50, 90, 95, 99):
        assert getattr(d, f"p{q}") == pytest.approx(np.percentile(values, q))
    assert d.stddev == pytest.approx(np.std(values)) and d.mean == pytest.approx(np.mean(values))
    assert (d.min, d.max, d.count) == (1.0, 9.0, 11)
    assert math.isnan(distribution([]).p50)


def test_goodput_counts_exactly_the_requests_within_every_slo_and_failures_against_it() -> None:
    records = [
        _record(0.0, ttft=0.050, gap=0.010, tokens=5),  # good
        _record(0.0, ttft=0.150, gap=0.010, tokens=5),  # TTFT over 100 ms
        _record(0.0, ttft=0.050, gap=0.030, tokens=5),  # ITL 30 ms over 20 ms
        _record(0.0, ttft=0.099, gap=0.019, tokens=5),  # good, just inside both
        RequestRecord(start=0.0, end=0.5, error="HTTP 500: injected failure"),
    ]
    summary = summarize([request_metrics(r, None) for r in records], parse_slo(["ttft=100", "itl=20"]))
    assert summary.num_failed == 1 and summary.num_completed == 4
    assert summary.errors == {"HTTP 500: injected failure": 1}
    assert summary.duration_s == pytest.approx(0.5)
    assert summary.goodput == pytest.approx(2 / 0.5)
    assert summary.good_fraction == pytest.approx(2 / 5)
    assert summary.request_throughput == pytest.approx(4 / 0.5)
    assert summary.output_token_throughput == pytest.approx(20 / 0.5)
    assert summary.total_token_throughput == pytest.approx((20 + 400) / 0.5)


@pytest.mark.parametrize("spec", ["ttft", "speed=3", "ttft=fast"], ids=["no-value", "unknown-key", "not-a-number"])
def test_a_malformed_slo_is_a_config_error_naming_the_item(spec: str) -> None:
    with pytest.raises(ConfigError, match="--slo"):
        parse_slo([spec])


def test_slo_items_may_be_space_or_comma_separated() -> None:
    assert parse_slo(["ttft=200 itl=25", "e2e=3000,tpot=40"]) == Slo(ttft=200, itl=25, e2e=3000, tpot=40)
