"""The shipped dashboard and rules query only series that dyn's metrics registries export, and the committed
copies under deploy/monitoring/ are what the code generates now."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from dynamo_cli.batch.metrics import BatchMetrics
from dynamo_cli.batch.store import BatchStore
from dynamo_cli.core.metrics import RouterMetrics
from dynamo_cli.frontend.metrics import FrontendMetrics
from dynamo_cli.kv.tier_stats import KvTierStats
from dynamo_cli.monitoring.alerts import alert_rules, render_rules
from dynamo_cli.monitoring.dashboard import build_dashboard, render_dashboard
from dynamo_cli.runtime.system import ComponentMetrics
from dynamo_cli.runtime.transport import RequestServer
from dynamo_cli.wire import LoadMetrics
from dynamo_cli.worker_metrics import WorkerMetrics
from tests.monitoring.promql import exported_series, metric_names

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"


def _batch_registry(state_dir: Path) -> CollectorRegistry:
    """The frontend's Batch API series (on its registry when batches are on), over a real store."""
    batches = CollectorRegistry()
    batches.register(BatchMetrics(BatchStore(state_dir / "batches.db"), lambda: 0))  # a runner: its inflight too
    return batches


def _registries(state_dir: Path) -> list[CollectorRegistry]:
    """Every registry a dyn process serves: the frontend's (with its batch series), a `dyn router`'s, a worker's
    system port."""
    component, worker = CollectorRegistry(), CollectorRegistry()
    component.register(ComponentMetrics(RequestServer(), "dynamo", "backend"))
    load = LoadMetrics(worker_id=1, kv_tiers=KvTierStats())  # tiers on: the kvbm_* series too
    worker.register(WorkerMetrics(lambda: load, "dynamo", "backend", "smollm2"))
    return [FrontendMetrics().registry, _batch_registry(state_dir), RouterMetrics().registry, component, worker]


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batches")


@pytest.fixture(scope="module")
def exported(state_dir: Path) -> set[str]:
    return exported_series(_registries(state_dir))


def unknown_series(exprs: list[str], exported: set[str]) -> dict[str, set[str]]:
    """expression -> the names it selects that no registry exports (only the expressions that have any)."""
    found = {expr: metric_names(expr) - exported for expr in exprs}
    return {expr: names for expr, names in found.items() if names}


def _dashboard_exprs(dashboard: dict[str, object]) -> list[str]:
    panels = dashboard["panels"]
    assert isinstance(panels, list)
    exprs = [target["expr"] for panel in panels for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:  # type: ignore[index]
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((\w+), *\w+\)", variable["query"])
            assert match, variable["query"]
            exprs.append(match.group(1))
    return exprs


def test_the_registries_export_what_the_system_ports_and_frontend_serve(exported: set[str]) -> None:
    # the check below is only as good as this list: spot-check a series of each registry
    assert {
        "dynamo_frontend_time_to_first_token_seconds_bucket",
        "dynamo_component_router_requests_total",
        "dynamo_component_requests_total",
        "dynamo_component_request_duration_seconds_count",
        "dynamo_component_kvstats_gpu_cache_usage_percent",
        "kvbm_host_cache_hit_rate",
        "dynamo_frontend_batch_lines",
        "dynamo_frontend_batch_tokens_total",
    } <= exported


def test_every_dashboard_query_names_only_exported_series(exported: set[str]) -> None:
    exprs = _dashboard_exprs(json.loads((DEPLOY / "dashboard.json").read_text()))
    assert len(exprs) > 40
    assert unknown_series(exprs, exported) == {}


def test_the_batch_api_row_draws_every_batch_series(state_dir: Path) -> None:
    dashboard = json.loads((DEPLOY / "dashboard.json").read_text())
    drawn = set().union(*(metric_names(expr) for expr in _dashboard_exprs(dashboard)))
    batch_series = exported_series([_batch_registry(state_dir)])
    assert batch_series == {
        "dynamo_frontend_batch_lines",
        "dynamo_frontend_batch_tokens_total",
        "dynamo_frontend_batch_inflight",
    }
    assert batch_series <= drawn
    titles = [p["title"] for p in dashboard["panels"]]
    row = titles.index("Batch API")
    assert titles[row + 1 : row + 4] == ["Batch lines by state", "Batch tokens/s", "Batch lines in flight"]


def test_every_alert_rule_names_only_exported_series(exported: set[str]) -> None:
    rules = yaml.safe_load((DEPLOY / "rules.yml").read_text())["groups"][0]["rules"]
    assert unknown_series([rule["expr"] for rule in rules], exported) == {}


def test_a_misspelt_series_is_caught(exported: set[str]) -> None:
    good = 'sum by (le) (rate(dynamo_frontend_time_to_first_token_seconds_bucket{model=~"$model"}[5m]))'
    wrong = good.replace("time_to_first_token", "time_to_first_tokens")
    counter_without_total = "rate(dynamo_frontend_requests[5m])"
    assert unknown_series([good, wrong, counter_without_total], exported) == {
        wrong: {"dynamo_frontend_time_to_first_tokens_seconds_bucket"},
        counter_without_total: {"dynamo_frontend_requests"},
    }


def test_the_committed_copies_are_what_the_code_generates() -> None:
    assert (DEPLOY / "dashboard.json").read_text() == render_dashboard(), "run: dyn monitoring dashboard -o ..."
    assert (DEPLOY / "rules.yml").read_text() == render_rules(alert_rules()), "run: dyn monitoring rules -o ..."


def test_the_dashboard_round_trips_through_the_sdk_model() -> None:
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    data = json.loads(render_dashboard())
    parsed = json.loads(json.dumps(Dashboard.from_json(data), cls=JSONEncoder))
    assert parsed == data == json.loads(json.dumps(build_dashboard(), cls=JSONEncoder))


def test_panels_have_unique_ids_fit_the_grid_and_draw_something() -> None:
    panels = json.loads(render_dashboard())["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    assert all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in panels)
    assert all(p["targets"] for p in panels if p["type"] != "row")
