"""The Prometheus scrape config of a deployment: one job over the frontend and every process's system port."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import yaml

from dynamo_cli.errors import ConfigError

JOB = "dynamo"
"""The scrape job's name: the `job` label of every series Prometheus stores from a deployment."""


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    """One `/metrics` endpoint Prometheus scrapes: a frontend's HTTP port or a worker's or router's system port."""

    host: str
    """Host name or IP address (IPv6 in brackets, as Prometheus writes it)."""
    port: int
    """TCP port, 1..65535."""

    @classmethod
    def parse(cls, text: str) -> ScrapeTarget:
        """`HOST:PORT` → a target; anything else is a ConfigError naming the value."""
        host, sep, port = text.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ConfigError(f"--target '{text}' is not HOST:PORT with a port 1..65535 (e.g. 127.0.0.1:8000)")
        return cls(host, int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def scrape_config(targets: Sequence[ScrapeTarget], *, interval_s: float = 15.0, rule_files: Sequence[str] = ()) -> str:
    """Prometheus YAML scraping `targets` every `interval_s` (rules evaluated as often), with `rule_files`."""
    if not targets:
        raise ConfigError("no scrape target; pass --target HOST:PORT once per frontend and system port")
    if not interval_s >= 0.001:
        raise ConfigError(f"--interval must be at least 0.001 seconds, got {interval_s}")
    interval = _duration(interval_s)
    config: dict[str, object] = {"global": {"scrape_interval": interval, "evaluation_interval": interval}}
    if rule_files:
        config["rule_files"] = list(rule_files)
    config["scrape_configs"] = [
        {
            "job_name": JOB,
            "metrics_path": "/metrics",
            "scrape_timeout": _duration(min(interval_s, 10.0)),
            "static_configs": [{"targets": [str(t) for t in targets]}],
        }
    ]
    return str(yaml.safe_dump(config, sort_keys=False))


def _duration(seconds: float) -> str:
    """Prometheus durations take whole units: 1.5 s is `1500ms`, 15 s is `15s`."""
    ms = round(seconds * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"
