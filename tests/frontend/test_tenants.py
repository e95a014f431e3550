"""Tenants at the edge (frontend/tenants.py, config/tenants.py): the key file's tenant lines, who a request is,
and each limit a 429 that names it."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dynamo_cli.config import PriorityClass, TenantConfig, TenantSpec, read_api_keys
from dynamo_cli.errors import ConfigError, Overloaded, RateLimited, RequestError
from dynamo_cli.frontend.tenants import KEY_INDEX_SCOPE, Tenants, TenantSeries


def _tenants(config: TenantConfig | None = None, keys_on: bool = False) -> tuple[Tenants, CollectorRegistry]:
    registry = CollectorRegistry()
    return Tenants(config or TenantConfig(), TenantSeries(registry, "dynamo_frontend"), keys_on), registry


def test_a_key_file_maps_keys_to_tenants_with_weights_limits_and_classes(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(
        "# team keys\n"
        "sk-a1 tenant=team-a weight=2 max-inflight=4 tpm=60000 max-queued=8 class=interactive max-class=system\n"
        "sk-a2 tenant=team-a\n"
        "sk-b tenant=team-b class=bulk\n"
        "sk-lone\n"
    )
    keys = read_api_keys([], str(key_file), {})
    assert keys.keys == ("sk-a1", "sk-a2", "sk-b", "sk-lone")
    a = TenantSpec("team-a", 2.0, 4, 60000, 8, PriorityClass.INTERACTIVE, PriorityClass.SYSTEM)
    assert keys.tenants[:2] == (a, a)
    assert keys.tenants[2] == TenantSpec("team-b", priority_class=PriorityClass.BULK)
    assert keys.tenants[3].name.startswith("key-") and len(keys.tenants[3].name) == 12


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("k colour=blue", "'colour=blue' is not one of"),
        ("k weight=heavy", "weight=heavy is not a valid float"),
        ("k weight=0", "weight=0 must be in"),
        ("k tpm=-5", "must be >= 0"),
        ("k class=urgent", "class 'urgent' is not a priority class"),
        ("k tenant=a/b", "tenant 'a/b' must be"),
        ("k class=interactive max-class=default", "above max-class=default"),
        ("k1 tenant=t weight=2\nk2 tenant=t weight=3", "line 2: tenant 't' has other settings"),
        ("k role=root", "role=root is unknown"),
    ],
)
def test_a_bad_key_file_line_is_a_config_error_naming_its_line_and_attribute(
    tmp_path: Path, line: str, message: str
) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(line + "\n")
    with pytest.raises(ConfigError, match=message) as raised:
        read_api_keys([], str(key_file), {})
    assert "line" in str(raised.value)


def test_role_admin_marks_an_admin_key_and_is_no_tenant_setting(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("ka role=admin tenant=ops\nkb tenant=ops\nkc\n")
    keys = read_api_keys(["kd"], str(key_file), {})
    assert keys.admins == ("ka",) and keys.keys == ("kd", "ka", "kb", "kc")
    assert [t.name for t in keys.tenants][1:3] == ["ops", "ops"]


def test_the_tenant_is_the_keys_else_the_header_else_default_and_the_class_is_capped() -> None:
    spec = TenantSpec("team-a", max_class=PriorityClass.SYSTEM)
    tenants, _ = _tenants(TenantConfig(key_tenants=(spec,)), keys_on=True)
    keyed = tenants.identify({KEY_INDEX_SCOPE: 0}, {b"x-dyn-tenant": b"someone-else"}, internal=False)
    assert keyed.name == "team-a" and keyed.priority_class is PriorityClass.DEFAULT
    system = tenants.identify({KEY_INDEX_SCOPE: 0}, {b"x-dyn-priority-class": b"system"}, internal=False)
    assert system.priority_class is PriorityClass.SYSTEM
    open_tenants, _ = _tenants()
    assert open_tenants.identify({}, {b"x-dyn-tenant": b"team-b"}, internal=False).name == "team-b"
    assert open_tenants.identify({}, {}, internal=False).name == "default"
    assert open_tenants.identify({}, {}, internal=True).priority_class is PriorityClass.BACKGROUND
    with pytest.raises(RequestError, match="priority class interactive at most, not system") as capped:
        open_tenants.identify({}, {b"x-dyn-priority-class": b"system"}, internal=False)
    assert capped.value.param == "x-dyn-priority-class"
    with pytest.raises(RequestError, match="must be one of") as bad:
        open_tenants.identify({}, {b"x-dyn-priority-class": b"urgent"}, internal=False)
    assert bad.value.param == "x-dyn-priority-class"
    for name in (b"a" * 65, b"a b", b"t\xff"):
        with pytest.raises(RequestError, match="x-dyn-tenant must be") as named:
            open_tenants.identify({}, {b"x-dyn-tenant": name}, internal=False)
        assert named.value.param == "x-dyn-tenant"
    no_header, _ = _tenants(TenantConfig(header=False))
    assert no_header.identify({}, {b"x-dyn-tenant": b"team-b"}, internal=False).name == "default"


def test_in_flight_and_tokens_a_minute_are_429s_that_name_the_limit() -> None:
    tenants, registry = _tenants(TenantConfig(max_inflight=2, tokens_per_minute=600))
    a = tenants.identify({}, {b"x-dyn-tenant": b"a"}, internal=False)
    tenants.admit(a)
    tenants.admit(a)
    with pytest.raises(RateLimited, match=r"tenant 'a' already has 2 requests in flight \(max-inflight\)") as busy:
        tenants.admit(a)
    assert busy.value.status == 429 and busy.value.limit == "max_inflight"
    tenants.spend_prompt(a, 500)
    with pytest.raises(RateLimited, match=r"over its 600 tokens a minute \(tpm\)") as spent:
        tenants.spend_prompt(a, 500)
    assert 35 < spent.value.retry_after <= 41  # 400 tokens short at 10 tokens/s
    tenants.release(a, "success", 100)  # the output is paid for too: the bucket is now below zero
    with pytest.raises(RateLimited):
        tenants.spend_prompt(a, 1)
    b = tenants.identify({}, {b"x-dyn-tenant": b"b"}, internal=False)
    tenants.admit(b)  # another tenant's limits are its own
    tenants.spend_prompt(b, 600)
    text = generate_latest(registry).decode()
    assert 'dynamo_frontend_tenant_rejections_total{limit="max_inflight",tenant="a"} 1.0' in text
    assert 'dynamo_frontend_tenant_tokens_total{kind="prompt",tenant="b"} 600.0' in text
    assert 'dynamo_frontend_tenant_requests_total{status="success",tenant="a"} 1.0' in text
    assert 'dynamo_frontend_tenant_requests_total{status="rejected",tenant="a"} 1.0' in text  # once, not twice


def test_the_table_of_header_tenants_is_bounded_and_a_forgotten_tenant_loses_its_series() -> None:
    tenants, registry = _tenants(TenantConfig(max_tenants=3))
    for name in (b"t1", b"t2", b"t3"):
        t = tenants.identify({}, {b"x-dyn-tenant": name}, internal=False)
        tenants.admit(t)
        tenants.release(t, "success", 5)
    busy = tenants.identify({}, {b"x-dyn-tenant": b"t2"}, internal=False)
    tenants.admit(busy)
    tenants.identify({}, {b"x-dyn-tenant": b"t4"}, internal=False)  # t1, least recently seen, goes
    text = generate_latest(registry).decode()
    assert 'tenant="t1"' not in text and 'tenant="t3"' in text
    tenants.identify({}, {b"x-dyn-tenant": b"t5"}, internal=False)  # t3 goes; t2 is in flight
    tenants.identify({}, {b"x-dyn-tenant": b"t6"}, internal=False)  # t4 goes
    tenants.admit(tenants.identify({}, {b"x-dyn-tenant": b"t5"}, internal=False))
    tenants.admit(tenants.identify({}, {b"x-dyn-tenant": b"t6"}, internal=False))
    with pytest.raises(Overloaded, match="tenant-table-size"):
        tenants.identify({}, {b"x-dyn-tenant": b"t7"}, internal=False)


def test_bad_tenant_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="--tenant-max-inflight must be >= 0"):
        TenantConfig(max_inflight=-1)
    with pytest.raises(ConfigError, match="--tenant-table-size must be >= 1"):
        TenantConfig(max_tenants=0)
