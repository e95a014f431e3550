"""`dyn monitoring` as a user runs it: the real binary writes what the generators make; bad input is one red line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dynamo_cli.monitoring.alerts import AlertTargets, alert_rules, render_rules
from dynamo_cli.monitoring.dashboard import render_dashboard
from dynamo_cli.monitoring.scrape import ScrapeTarget, scrape_config


def dyn(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynamo_cli.cli.main", "monitoring", *args], capture_output=True, text=True, timeout=60
    )


def test_each_command_writes_what_the_code_generates(tmp_path: Path) -> None:
    scrape = dyn("scrape-config", "-t", "127.0.0.1:8000", "-t", "localhost:9100", "--interval", "1", "--rules", "r.yml")
    assert scrape.returncode == 0, scrape.stderr
    targets = [ScrapeTarget("127.0.0.1", 8000), ScrapeTarget("localhost", 9100)]
    assert scrape.stdout == scrape_config(targets, interval_s=1, rule_files=["r.yml"])
    rules = dyn("rules", "--ttft-target-ms", "750", "--out", str(tmp_path / "rules.yml"))
    assert rules.returncode == 0 and rules.stdout == "", rules.stderr
    assert (tmp_path / "rules.yml").read_text() == render_rules(alert_rules(AlertTargets(ttft_target_s=0.75)))
    dashboard = dyn("dashboard")
    assert dashboard.returncode == 0 and dashboard.stdout == render_dashboard(), dashboard.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(("scrape-config", "-t", "nohost"), "--target 'nohost' is not HOST:PORT", id="target-no-port"),
        pytest.param(("scrape-config", "-t", "h:70000"), "--target 'h:70000' is not HOST:PORT", id="port-range"),
        pytest.param(("scrape-config",), "Missing option '--target'", id="no-target"),
        pytest.param(("scrape-config", "-t", "h:1", "--interval", "0"), "--interval must be at least", id="interval"),
        pytest.param(("rules", "--ttft-target-ms", "-5"), "pass a positive --ttft-target-ms", id="ttft-negative"),
        pytest.param(("dashboard", "-o", "/nonexistent/d.json"), "--out '/nonexistent/d.json' cannot", id="out-dir"),
    ],
)
def test_bad_input_is_one_red_line_and_a_non_zero_exit(args: tuple[str, ...], message: str) -> None:
    result = dyn(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
