"""The selector tokenizer the dashboard and rules checks rest on."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tests.monitoring.promql import exported_series, metric_names


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        pytest.param("up", {"up"}, id="bare-name"),
        pytest.param('a_total{model=~"$model", le="0.5"}', {"a_total"}, id="label-names-and-values-skipped"),
        pytest.param(
            "histogram_quantile(0.9, sum by (model, le) (rate(x_bucket[5m])))", {"x_bucket"}, id="functions-grouping"
        ),
        pytest.param("sum without (instance) (a) / on (model) group_left (worker) b", {"a", "b"}, id="vector-matching"),
        pytest.param("rate(a[$__rate_interval] offset 5m) > bool 1e9", {"a"}, id="windows-durations-numbers"),
        pytest.param('c{x="}"} and d{y="a{2}"}', {"c", "d"}, id="braces-inside-strings"),
        pytest.param("topk(3, sum(increase(e:rule[1h])))", {"e:rule"}, id="recording-rule-name"),
    ],
)
def test_metric_names_finds_only_the_selected_series(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_exported_series_names_every_sample_of_each_family_even_without_samples() -> None:
    registry = CollectorRegistry()
    Counter("c", "", ["model"], registry=registry)
    Gauge("g", "", registry=registry)
    Histogram("h_seconds", "", ["model"], registry=registry)
    assert exported_series([registry]) == {"c_total", "g", "h_seconds_bucket", "h_seconds_sum", "h_seconds_count"}
