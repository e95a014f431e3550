"""`dyn monitoring`: print a deployment's Prometheus scrape config, alerting rules or Grafana dashboard."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dynamo_cli.errors import ConfigError
from dynamo_cli.monitoring.alerts import AlertTargets, alert_rules, render_rules
from dynamo_cli.monitoring.scrape import ScrapeTarget, scrape_config

app = typer.Typer(
    help="Monitoring a deployment: a Prometheus scrape config, alerting rules and a Grafana dashboard.",
    no_args_is_help=True,
)

Out = Annotated[Path | None, typer.Option("--out", "-o", help="Write to this file instead of stdout.")]


def _write(text: str, out: Path | None) -> None:
    if out is None:
        typer.echo(text, nl=False)
        return
    try:
        out.write_text(text)
    except OSError as exc:
        raise ConfigError(f"--out '{out}' cannot be written: {exc.strerror}") from None


@app.command("scrape-config")
def scrape(
    target: Annotated[
        list[str],
        typer.Option("--target", "-t", help="HOST:PORT of a frontend or a --system-port (repeatable)."),
    ],
    interval: Annotated[float, typer.Option("--interval", help="Scrape (and rule evaluation) interval, s.")] = 15.0,
    rules: Annotated[list[str] | None, typer.Option("--rules", help="Rules file to load (repeatable).")] = None,
    out: Out = None,
) -> None:
    """Prometheus YAML scraping the frontend's /metrics and every process's system port."""
    targets = [ScrapeTarget.parse(t) for t in target]
    _write(scrape_config(targets, interval_s=interval, rule_files=rules or ()), out)


@app.command("rules")
def rules_command(
    ttft_target_ms: Annotated[
        float, typer.Option("--ttft-target-ms", help="TTFT p90 (ms) over which an alert fires.")
    ] = AlertTargets().ttft_target_s * 1000,
    out: Out = None,
) -> None:
    """Prometheus alerting rules: no workers, TTFT over target, queue timing out, restarts, KV pulls, stalls."""
    _write(render_rules(alert_rules(AlertTargets(ttft_target_s=ttft_target_ms / 1000))), out)


@app.command("dashboard")
def dashboard(out: Out = None) -> None:
    """Grafana dashboard JSON (Dashboards → New → Import) over the frontend's and workers' series."""
    try:
        from dynamo_cli.monitoring.dashboard import render_dashboard
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("grafana_foundation_sdk"):
            raise
        raise ConfigError(
            "the dashboard is built with grafana-foundation-sdk, which is not installed; "
            "install it with: pip install 'dynamo-cli[monitoring]'"
        ) from None
    _write(render_dashboard(), out)
