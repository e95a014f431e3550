"""The multi-tenant workload: `--tenant` specs, each tenant's identity and load, and its figures, 429s included."""

from __future__ import annotations

import json

import pytest
from sse_server import Rhythm, prompt_words
from typer.testing import CliRunner

from dynamo_cli.bench.http import HttpClient
from dynamo_cli.bench.load import LoadConfig
from dynamo_cli.bench.metrics import RequestMetrics
from dynamo_cli.bench.session import BenchConfig, WorkloadConfig, run_bench
from dynamo_cli.bench.tenants import TenantLoad, parse_tenant, parse_tenants, tenant_figures
from dynamo_cli.cli.bench import app
from dynamo_cli.errors import ConfigError

FAST = ["--isl", "8", "--osl", "4", "--no-progress", "--tokenizer", "none"]


##### specs #####


def test_a_full_tenant_spec_parses_into_every_field() -> None:
    tenant = parse_tenant("name=a,isl=4000,osl=64,rate=5,weight=2.5,class=Bulk,key=sk-x=y")
    assert tenant == TenantLoad("a", 4000.0, 64.0, 5.0, None, 2.5, "bulk", "sk-x=y")
    assert "sk-x" not in repr(tenant) and "key" not in tenant.public() and tenant.public()["has_key"] is True


def test_a_tenant_with_only_a_name_takes_the_runs_lengths_and_load() -> None:
    tenant = parse_tenant("name=ops.team_1")
    assert tenant == TenantLoad("ops.team_1")
    base = LoadConfig(concurrency=3, num_requests=5, seed=1)
    assert tenant.load(base, 0).concurrency == 3 and tenant.load(base, 0).request_rate is None


def test_a_tenants_rate_is_a_poisson_open_loop_and_its_concurrency_a_closed_loop() -> None:
    base = LoadConfig(concurrency=3, num_requests=5, duration_s=9.0)
    rated = parse_tenant("name=a,rate=5").load(base, 0)
    assert (rated.request_rate, rated.concurrency, rated.arrival, rated.duration_s) == (5.0, None, "poisson", 9.0)
    closed = parse_tenant("name=b,concurrency=7").load(base, 1)
    assert (closed.request_rate, closed.concurrency, closed.num_requests) == (None, 7, 5)
    assert rated.seed != closed.seed  # tenants draw their gaps apart


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        pytest.param("isl=5", "name= is required", id="no-name"),
        pytest.param("name=", "name='' must be 1-64 of", id="empty-name"),
        pytest.param("name=a b", "name='a b' must be 1-64 of", id="name-with-space"),
        pytest.param("name=a,speed=3", "'speed=3' is not one of name=, isl=", id="unknown-field"),
        pytest.param("name=a,rate", "'rate' is not one of", id="no-equals"),
        pytest.param("name=a,rate=x", "rate=x must be a number > 0", id="rate-not-a-number"),
        pytest.param("name=a,rate=0", "rate=0 must be a number > 0", id="rate-zero"),
        pytest.param("name=a,isl=-4", "isl=-4 must be a number > 0", id="negative-isl"),
        pytest.param("name=a,osl=inf", "osl=inf must be a number > 0", id="infinite-osl"),
        pytest.param("name=a,weight=nan", "weight=nan must be a number > 0", id="nan-weight"),
        pytest.param(
            "name=a,concurrency=1.5", "concurrency=1.5 must be a whole number > 0", id="fractional-concurrency"
        ),
        pytest.param(
            "name=a,class=urgent", "class=urgent is not one of bulk, default, interactive, system", id="class"
        ),
        pytest.param(
            "name=a,rate=2,concurrency=2", "give rate= (open loop) or concurrency=", id="rate-and-concurrency"
        ),
        pytest.param("name=a,isl=2,isl=3", "isl= is given twice", id="field-twice"),
        pytest.param("name=a,key=", "key= must be printable", id="empty-key"),
    ],
)
def test_a_bad_tenant_spec_is_one_config_error_naming_the_field(spec: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_tenant(spec)
    text = str(caught.value)
    assert text.startswith("--tenant '") and message in text and "\n" not in text


def test_a_tenants_key_never_shows_in_an_error() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_tenant("name=a,key=sk-secret-1,rate=oops")
    assert "sk-secret-1" not in str(caught.value) and "key=…" in str(caught.value)


def test_two_tenants_of_one_name_are_refused() -> None:
    with pytest.raises(ConfigError, match="name=a is given twice"):
        parse_tenants(["name=a", "name=b", "name=a,rate=1"])


def test_a_tenant_sends_its_key_else_its_name_and_its_class_when_it_has_one() -> None:
    assert parse_tenant("name=a").headers() == (("x-dyn-tenant", "a"),)
    assert parse_tenant("name=a,key=sk-1,class=system").headers() == (
        ("authorization", "Bearer sk-1"),
        ("x-dyn-priority-class", "system"),
    )


def test_tenants_refuse_a_sweep_and_a_trace() -> None:
    with pytest.raises(ConfigError, match="--tenant sets each tenant's load; drop --sweep and --trace"):
        BenchConfig(load=LoadConfig(num_requests=2), tenants=parse_tenants(["name=a"]), sweep=("concurrency", (1.0,)))


##### figures #####


def _metrics(tenant: str, status: int, ttft: float = 10.0, retry_after: float | None = None) -> RequestMetrics:
    ok = status == 200
    return RequestMetrics(
        is_ok=ok,
        error=None if ok else f"HTTP {status}: x",
        start=0.0,
        end=1.0,
        ttft=ttft if ok else None,
        e2e=ttft * 2,
        itl=None,
        tpot=None,
        chunk_gaps=(),
        input_tokens=8,
        output_tokens=4 if ok else 0,
        has_usage=ok,
        status=status,
        retry_after=retry_after,
        tenant=tenant,
    )


def test_tenant_figures_count_rejections_apart_from_other_errors_with_their_retry_after() -> None:
    tenants = parse_tenants(["name=a,weight=3", "name=b,class=bulk"])
    metrics = [
        *(_metrics("a", 200, ttft) for ttft in (10.0, 20.0, 30.0)),
        _metrics("a", 500),
        _metrics("b", 200, 40.0),
        _metrics("b", 429, retry_after=2.0),
        _metrics("b", 429, retry_after=6.0),
        _metrics("b", 429),  # a 429 without Retry-After: a rejection, not in the mean
    ]
    a, b = tenant_figures(metrics, tenants, duration_s=2.0)
    assert (a.num_sent, a.num_completed, a.num_rejected, a.num_errors) == (4, 3, 0, 1)
    assert (a.ttft_p50, a.ttft_p90, a.e2e_p50) == (20.0, 28.0, 40.0)
    assert (a.output_token_throughput, a.output_share, a.weight_share) == (6.0, 0.75, 0.75)
    assert (a.retry_after_mean, a.retry_after_max) == (None, None)
    assert (b.num_sent, b.num_completed, b.num_rejected, b.num_errors) == (4, 1, 3, 0)
    assert (b.priority_class, b.output_share, b.weight_share) == ("bulk", 0.25, 0.25)
    assert (b.retry_after_mean, b.retry_after_max) == (4.0, 6.0)


##### runs #####


async def test_a_429_with_retry_after_is_a_failed_record_with_its_wait(serve) -> None:
    async with serve(Rhythm(reject_tenant="b", retry_after="7")) as url, HttpClient(url) as client:
        body = {"model": "test-model", "max_tokens": 3}
        record = await client.stream("/v1/chat/completions", body, headers=[("x-dyn-tenant", "b")])
    assert (record.status, record.retry_after) == (429, 7.0)
    assert record.error == "HTTP 429: tenant over its limit"


async def test_each_tenant_sends_its_own_prompts_and_headers_and_is_counted_apart(serve) -> None:
    rhythm = Rhythm(ttft_s=0.0, gap_s=0.0, reject_tenant="b", retry_after="3")
    tenants = parse_tenants(["name=a,concurrency=2,isl=12", "name=b,rate=200,class=bulk", "name=c,key=sk-c,osl=2"])
    async with serve(rhythm) as url:
        config = BenchConfig(
            url=url,
            load=LoadConfig(num_requests=6, concurrency=1),
            workload=WorkloadConfig(isl=5, osl=4),
            tokenizer="none",
            tenants=tenants,
        )
        result = await run_bench(config)
    run = result.runs[0]
    a, b, c = run.tenants
    assert (a.name, a.num_sent, a.num_completed, a.num_rejected, a.num_errors) == ("a", 6, 6, 0, 0)
    assert (b.name, b.num_sent, b.num_completed, b.num_rejected, b.num_errors) == ("b", 6, 0, 6, 0)
    assert (b.retry_after_mean, b.retry_after_max, b.priority_class) == (3.0, 3.0, "bulk")
    assert (c.num_completed, c.output_share) == (6, pytest.approx(12 / (24 + 12)))  # osl 2 against a's 4
    assert run.summary.num_failed == 6 and run.summary.errors == {"HTTP 429: tenant over its limit": 6}
    posts = list(zip(rhythm.headers[1:], rhythm.bodies[1:], strict=True))  # the first POST is the probe
    by_tenant = {name: [(h, b) for h, b in posts if h.get("x-dyn-tenant") == name] for name in ("a", "b")}
    by_tenant["c"] = [(h, b) for h, b in posts if h.get("authorization") == "Bearer sk-c"]
    assert [len(v) for v in by_tenant.values()] == [6, 6, 6]
    assert all(len(prompt_words(body)) == 12 for _, body in by_tenant["a"])
    assert all(len(prompt_words(body)) == 5 and body["max_tokens"] == 2 for _, body in by_tenant["c"])
    assert all(h.get("x-dyn-priority-class") == "bulk" for h, _ in by_tenant["b"])
    assert not any("x-dyn-priority-class" in h or "x-dyn-tenant" in h for h, _ in by_tenant["c"])


def test_the_cli_prints_a_row_per_tenant_and_writes_a_tenants_section(serve_in_thread, tmp_path) -> None:
    out = tmp_path / "tenants.json"
    specs = ["--tenant", "name=alpha,concurrency=2", "--tenant", "name=beta,rate=100,class=bulk,key=sk-beta"]
    with serve_in_thread(Rhythm(ttft_s=0.0, gap_s=0.0)) as url:
        result = CliRunner().invoke(app, ["--url", url, "-n", "4", *FAST, *specs, "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = [line.split("│")[1].strip() for line in result.output.splitlines() if line.startswith("│")]
    assert rows[-2:] == ["alpha", "beta"]  # the tenants table closes the report's tables
    text = out.read_text()
    document = json.loads(text)
    assert [(t["name"], t["num_sent"], t["num_completed"]) for t in document["tenants"]] == [
        ("alpha", 4, 4),
        ("beta", 4, 4),
    ]
    assert [t["name"] for t in document["info"]["tenants"]] == ["alpha", "beta"]
    assert "sk-beta" not in text and "sk-beta" not in result.output


def test_a_bad_tenant_on_the_command_line_fails_with_its_one_line() -> None:
    result = CliRunner().invoke(app, ["--url", "http://127.0.0.1:1", "--tenant", "name=a,class=urgent"])
    assert isinstance(result.exception, ConfigError)
    assert str(result.exception) == (
        "--tenant 'name=a,class=urgent': class=urgent is not one of bulk, default, interactive, system"
    )


def test_the_bench_speaks_the_frontends_tenant_headers_and_classes() -> None:
    from dynamo_cli.bench import tenants as bench
    from dynamo_cli.config import tenants as server

    assert (bench.TENANT_HEADER, bench.CLASS_HEADER) == (server.TENANT_HEADER, server.CLASS_HEADER)
    assert bench.PRIORITY_CLASSES == tuple(server.CLIENT_CLASSES)
