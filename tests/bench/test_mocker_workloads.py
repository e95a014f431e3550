"""The agentic and multi-tenant workloads end to end: `dyn bench` against a real `dyn serve --engine mocker`."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from dynamo_cli.cli.bench import app

MOCKER = ("--engine", "mocker", "--speedup-ratio", "10")


def test_an_agent_run_finds_the_context_of_later_calls_cached_and_none_of_the_first(dyn_serve, tmp_path) -> None:
    d = dyn_serve(*MOCKER)
    out = tmp_path / "agents.json"
    agent = ["--agent-sessions", "3", "--agent-calls", "4", "--agent-system-len", "300", "--agent-tool-len", "60"]
    agent += ["--agent-tool-gap", "const:0.05", "--agent-resume-hint"]
    args = ["--url", d.url, "--api-key", d.key, *agent, "--osl", "8", "--no-progress", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert document["summary"]["num_completed"] == 12 and document["info"]["is_tokenizer_exact"]
    first, later = document["agent"]["calls"]
    assert (first["calls"], first["num_completed"], later["calls"], later["num_completed"]) == ("1", 3, "2..4", 9)
    # call 1 shares only the chat template's first tokens with anything sent before (under one KV block); call
    # k > 1 finds call k-1's whole prompt (all but its last, partial block) cached on the one worker
    assert first["cache_hit_rate"] < 0.05, first
    assert later["cache_hit_rate"] > 0.6, later
    assert later["ttft_p50"] is not None and "agent sessions, by call" in result.output


def test_tenants_run_at_once_each_counted_in_its_own_row(dyn_serve, tmp_path) -> None:
    d = dyn_serve(*MOCKER)
    out = tmp_path / "tenants.json"
    tenants = ["--tenant", "name=a,concurrency=2,isl=200", "--tenant", "name=b,rate=20,class=bulk"]
    tenants += ["--tenant", f"name=c,key={d.key},class=interactive,osl=4"]
    args = ["--url", d.url, "--api-key", d.key, "-n", "6", "--isl", "64", "--osl", "8", "--no-progress"]
    result = CliRunner().invoke(app, [*args, *tenants, "--json", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    rows = {t["name"]: t for t in json.loads(text)["tenants"]}
    assert list(rows) == ["a", "b", "c"]
    for row in rows.values():
        assert (row["num_sent"], row["num_completed"], row["num_rejected"], row["num_errors"]) == (6, 6, 0, 0), row
        assert row["ttft_p50"] > 0 and row["e2e_p99"] >= row["e2e_p50"]
    assert rows["c"]["output_share"] == 24 / (48 + 48 + 24)  # its 4 output tokens a request against 8
    assert d.key not in text and d.key not in result.output
