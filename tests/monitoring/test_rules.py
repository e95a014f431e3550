"""The alerting rules and scrape config, checked by Prometheus's own promtool: the rules parse, and each alert
fires on synthetic series that should fire it and not on a neighbour that should not (`promtool test rules`)."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from dynamo_cli.monitoring.alerts import AlertTargets, alert_rules, render_rules
from dynamo_cli.monitoring.scrape import ScrapeTarget, scrape_config

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool missing: Debian's prometheus package (bash .ci/install-planes.sh as root)"
)


@dataclass(frozen=True)
class Case:
    """Input series (1 m apart) and the alerts expected firing at `at`, by their labels."""

    alert: str
    series: dict[str, str]
    at: str
    firing: list[dict[str, str]] = field(default_factory=list)


def _buckets(metric: str, labels: str, counts: dict[str, int]) -> dict[str, str]:
    """Cumulative histogram buckets gaining `counts[le]` observations each minute, for 30 minutes."""
    return {f'{metric}_bucket{{{labels}, le="{le}"}}': f"0+{n}x30" for le, n in counts.items()}


TTFT, QUEUE = "dynamo_frontend_time_to_first_token_seconds", "dynamo_frontend_queue_wait_seconds"
CASES = [
    Case(
        "DynamoNoWorkers",
        {'dynamo_frontend_workers{model="gone"}': "0x10", 'dynamo_frontend_workers{model="ok"}': "1x10"},
        "5m",
        [{"model": "gone"}],
    ),
    # `for: 1m`: a model that has just lost its workers is pending, not firing
    Case("DynamoNoWorkers", {'dynamo_frontend_workers{model="gone"}': "0x10"}, "0m"),
    Case(
        "DynamoTtftOverTarget",  # slow: every first token between 2.5 and 5 s; fast: under 0.1 s
        {
            **_buckets(TTFT, 'model="slow"', {"0.1": 0, "2.5": 0, "5": 10, "+Inf": 10}),
            **_buckets(TTFT, 'model="fast"', {"0.1": 10, "2.5": 10, "5": 10, "+Inf": 10}),
        },
        "15m",
        [{"model": "slow"}],
    ),
    Case(
        "DynamoQueueTimingOut",  # slow: waits of 0.25..0.5 s (the default timeout); fast: under 10 ms
        {
            **_buckets(QUEUE, 'model="slow"', {"0.01": 0, "0.25": 0, "0.5": 5, "+Inf": 5}),
            **_buckets(QUEUE, 'model="fast"', {"0.01": 5, "0.25": 5, "0.5": 5, "+Inf": 5}),
        },
        "15m",
        [{"model": "slow"}],
    ),
    Case(
        "DynamoWorkerRestarts",
        {
            'dynamo_frontend_worker_restarts_total{instance="a"}': "0 0 0 1 1 1 1 1",
            'dynamo_frontend_worker_restarts_total{instance="b"}': "0x8",
        },
        "5m",
        [{"instance": "a"}],
    ),
    Case(
        "DynamoKvTransferFailures",  # `local`: the pull failed and the decode worker prefilled the prompt itself
        {
            'dynamo_frontend_kv_transfer_seconds_count{model="broken", backend="local"}': "0 0 1 2 2 2",
            'dynamo_frontend_kv_transfer_seconds_count{model="ok", backend="tcp"}': "0+5x6",
            'dynamo_frontend_kv_transfer_seconds_count{model="ok", backend="local"}': "0x6",
        },
        "4m",
        [{"model": "broken"}],
    ),
    Case(
        "DynamoWorkerStalls",
        {
            'dynamo_frontend_worker_stalls_total{model="m", worker_id="1a", reason="itl"}': "0 0 1 1 1",
            'dynamo_frontend_worker_stalls_total{model="m", worker_id="2b", reason="itl"}': "0x5",
        },
        "3m",
        [{"model": "m", "worker_id": "1a"}],
    ),
    Case(
        "DynamoKvRoutingBlind",
        {
            'dynamo_frontend_worker_kv_events{model="m", worker_id="1a", dp_rank="0", worker_type="both"}': "0x25",
            'dynamo_frontend_worker_kv_events{model="m", worker_id="2b", dp_rank="0", worker_type="both"}': "1x25",
            'dynamo_frontend_worker_kv_events{model="rr", worker_id="3c", dp_rank="0", worker_type="both"}': "-1x25",
        },
        "20m",
        [{"model": "m", "worker_id": "1a"}],
    ),
]


def _expected(alert: str, labels: dict[str, str]) -> dict[str, object]:
    rule = next(r for r in alert_rules() if r.name == alert)

    def expand(template: str) -> str:
        return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], template)

    return {
        "exp_labels": {**labels, "severity": rule.severity},
        "exp_annotations": {"summary": expand(rule.summary), "description": expand(rule.description)},
    }


def _promtool_tests(cases: list[Case]) -> dict[str, object]:
    return {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in case.series.items()],
                "alert_rule_test": [
                    {
                        "eval_time": case.at,
                        "alertname": case.alert,
                        "exp_alerts": [_expected(case.alert, labels) for labels in case.firing],
                    }
                ],
            }
            for case in cases
        ],
    }


def _promtool(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)


@pytest.fixture
def rules_file(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yml"
    path.write_text(render_rules(alert_rules()))
    return path


def test_promtool_checks_the_rules(rules_file: Path, tmp_path: Path) -> None:
    result = _promtool(tmp_path, "check", "rules", str(rules_file))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_every_alert_fires_on_its_series_and_not_on_its_neighbours(rules_file: Path, tmp_path: Path) -> None:
    assert {case.alert for case in CASES} == {rule.name for rule in alert_rules()}, "a case for every alert"
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(_promtool_tests(CASES), sort_keys=False))
    result = _promtool(tmp_path, "test", "rules", "tests.yml")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("case", [c for c in CASES if c.firing], ids=lambda c: c.alert)
def test_promtool_fails_when_the_wrong_series_is_expected_to_fire(case: Case, tmp_path: Path) -> None:
    """The unit test can fail: expecting the neighbour (or nothing) to fire instead is caught."""
    (tmp_path / "rules.yml").write_text(render_rules(alert_rules()))
    wrong = Case(case.alert, case.series, case.at, [])
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(_promtool_tests([wrong]), sort_keys=False))
    result = _promtool(tmp_path, "test", "rules", "tests.yml")
    assert result.returncode != 0 and case.alert in result.stdout + result.stderr


def test_a_lower_ttft_target_fires_on_faster_first_tokens(tmp_path: Path) -> None:
    (tmp_path / "rules.yml").write_text(render_rules(alert_rules(AlertTargets(ttft_target_s=0.05))))
    fast = next(c for c in CASES if c.alert == "DynamoTtftOverTarget")
    case = Case(fast.alert, fast.series, fast.at, [{"model": "slow"}, {"model": "fast"}])
    tests = _promtool_tests([case])
    for expected in tests["tests"][0]["alert_rule_test"][0]["exp_alerts"]:  # type: ignore[index]
        model = expected["exp_labels"]["model"]
        expected["exp_annotations"]["summary"] = f"TTFT p90 of model {model} is over 0.05 s"
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    result = _promtool(tmp_path, "test", "rules", "tests.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_checks_the_scrape_config(tmp_path: Path, rules_file: Path) -> None:
    targets = [ScrapeTarget.parse("127.0.0.1:8000"), ScrapeTarget.parse("[::1]:9100")]
    (tmp_path / "prometheus.yml").write_text(scrape_config(targets, interval_s=1.5, rule_files=[str(rules_file)]))
    result = _promtool(tmp_path, "check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr
