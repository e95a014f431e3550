"""The agentic workload: tool-gap distributions, the growing context, session headers and hints, figures by call."""

from __future__ import annotations

import json
import random
import statistics

import pytest
from sse_server import Rhythm, prompt_words
from typer.testing import CliRunner

from dynamo_cli.bench import workload as wl
from dynamo_cli.bench.agents import SESSION_HEADER, AgentConfig, ToolGap, agent_sessions, call_figures, parse_gap
from dynamo_cli.bench.load import LoadConfig, RequestBuilder, extended, opening
from dynamo_cli.bench.metrics import RequestMetrics
from dynamo_cli.bench.session import BenchConfig, WorkloadConfig, run_bench
from dynamo_cli.cli.bench import app
from dynamo_cli.errors import ConfigError

FAST = ["--osl", "3", "--no-progress", "--tokenizer", "none"]


@pytest.fixture(scope="module")
def vocab() -> wl.Vocab:
    return wl.approximate_vocab("approximate (test)")


##### tool gaps #####


@pytest.mark.parametrize(
    ("spec", "gap", "mean"),
    [
        pytest.param("exp:2.0", ToolGap("exp", 2.0), 2.0, id="exponential"),
        pytest.param("const:1.5", ToolGap("const", 1.5), 1.5, id="constant"),
        pytest.param("const:0", ToolGap("const", 0.0), 0.0, id="no-gap"),
        pytest.param(" uniform:0.5:3 ", ToolGap("uniform", 0.5, 3.0), 1.75, id="uniform"),
    ],
)
def test_a_tool_gap_spec_parses_into_its_distribution(spec: str, gap: ToolGap, mean: float) -> None:
    parsed = parse_gap(spec)
    assert parsed == gap and parsed.mean == mean
    assert parse_gap(str(parsed)) == parsed  # the default shown in --help parses back


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        pytest.param("", "unknown distribution ''", id="empty"),
        pytest.param("gauss:1", "unknown distribution 'gauss'", id="unknown-kind"),
        pytest.param("exp", "exp takes 1 number", id="no-value"),
        pytest.param("exp:1:2", "exp takes 1 number", id="too-many-values"),
        pytest.param("uniform:1", "uniform takes 2 number", id="uniform-one-value"),
        pytest.param("exp:x", "'x' is not a number of seconds", id="not-a-number"),
        pytest.param("const:-1", "'-1' is not a number of seconds >= 0", id="negative"),
        pytest.param("const:nan", "'nan' is not a number", id="nan"),
        pytest.param("exp:inf", "'inf' is not a number", id="infinite"),
        pytest.param("exp:0", "an exponential's mean must be > 0", id="zero-mean"),
        pytest.param("uniform:3:1", "LOW (3) is above HIGH (1)", id="reversed-bounds"),
    ],
)
def test_a_bad_tool_gap_is_one_config_error_naming_what_is_wrong(spec: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_gap(spec)
    text = str(caught.value)
    assert text.startswith(f"--agent-tool-gap {spec!r}") and message in text and "\n" not in text


@pytest.mark.parametrize(
    ("spec", "low", "high"),
    [
        pytest.param("exp:2.0", 0.0, float("inf"), id="exponential"),
        pytest.param("uniform:0.5:3", 0.5, 3.0, id="uniform"),
        pytest.param("const:1.5", 1.5, 1.5, id="constant"),
    ],
)
def test_seeded_gaps_are_reproducible_stay_in_range_and_average_the_mean(spec: str, low: float, high: float) -> None:
    gap = parse_gap(spec)
    draws = [gap.draw(random.Random(5)) for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]  # one seed, one draw
    rng = random.Random(11)
    values = [gap.draw(rng) for _ in range(20_000)]
    assert all(low <= v <= high for v in values)
    # exponential: the mean of 20,000 draws has a standard error of 0.7 %; 3 % is > 4 standard errors
    assert statistics.fmean(values) == pytest.approx(gap.mean, rel=0.03)
    if gap.kind == "exp":
        assert statistics.pstdev(values) == pytest.approx(gap.mean, rel=0.05)  # an exponential's stddev is its mean


##### the sessions #####


def _agent(**fields: object) -> AgentConfig:
    values: dict[str, object] = {"sessions": 3, "calls": 4, "system_len": 50, "instruction_len": 7, "tool_len": 20}
    return AgentConfig(**{**values, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_each_calls_prompt_starts_with_the_previous_calls_and_grows_by_the_stated_lengths(
    vocab: wl.Vocab, endpoint: str
) -> None:
    builder = RequestBuilder("m", endpoint)  # type: ignore[arg-type]
    sessions = list(agent_sessions(vocab, _agent(), osl=5, osl_stddev=0, seed=2))
    assert len(sessions) == 3 and len({s.system.split()[0] for s in sessions if s.system}) == 3
    for session in sessions:
        assert session.system is not None and len(session.system.split()) == 50
        history = opening(session)
        prompts: list[str] = []
        for call, turn in enumerate(session.turns):
            body = builder.body(history, turn)
            prompt = "".join(m["content"] for m in body["messages"]) if endpoint == "chat" else body["prompt"]
            if prompts:
                assert prompt.startswith(prompts[-1])  # the prefix property
                if endpoint == "chat":
                    assert body["messages"][: len(history) - 1] == history[:-1]
            reply = " re" * (call + 2)  # a reply of call + 2 tokens
            prompts.append(prompt)
            history = extended(history, turn, reply)
        lengths = [len(p.split()) for p in prompts]
        assert lengths[0] == 50 + 7
        # call k adds: call k-1's reply (k + 1 tokens), its tool output (20) and its own instruction (7)
        assert [b - a for a, b in zip(lengths, lengths[1:], strict=False)] == [2 + 20 + 7, 3 + 20 + 7, 4 + 20 + 7]


def test_without_a_system_prompt_the_first_instruction_carries_the_sessions_marker(vocab: wl.Vocab) -> None:
    sessions = list(agent_sessions(vocab, _agent(system_len=0), osl=5, osl_stddev=0))
    assert all(s.system is None for s in sessions)
    firsts = [s.turns[0].text.split() for s in sessions]
    assert [len(words) for words in firsts] == [7, 7, 7] and len({words[0] for words in firsts}) == 3


def test_calls_carry_the_session_header_and_all_but_the_last_the_resume_hint(vocab: wl.Vocab) -> None:
    config = _agent(tool_gap=parse_gap("uniform:1:2"), resume_hint=True)
    first, second = list(agent_sessions(vocab, config, osl=5, osl_stddev=0, seed=9, offset=10))[:2]
    assert first.headers == ((SESSION_HEADER, "agent-9-10"),) and second.headers == ((SESSION_HEADER, "agent-9-11"),)
    hints = [t.extra for t in first.turns]
    assert hints == [{"nvext": {"agent_hints": {"resume_after_s": 3.0}}}] * 3 + [None]  # 2 × the mean, 1.5 s
    gaps = [t.gap_s for t in first.turns]
    assert gaps[0] == 0.0 and all(1.0 <= g <= 2.0 for g in gaps[1:])
    plain = list(agent_sessions(vocab, _agent(session_header=False), osl=5, osl_stddev=0))[0]
    assert plain.headers == () and all(t.extra is None for t in plain.turns)
    assert RequestBuilder("m").body([], first.turns[0])["nvext"] == {"agent_hints": {"resume_after_s": 3.0}}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param({"calls": 0}, "--agent-calls (0) >= 1", id="no-calls"),
        pytest.param({"sessions": -1}, "--agent-sessions (-1) must be >= 0", id="negative-sessions"),
        pytest.param({"instruction_len": 0}, "--agent-instruction-len (0) >= 1", id="no-instruction"),
        pytest.param({"tool_len": -1}, "--agent-tool-len (-1)", id="negative-tool"),
        pytest.param({"resume_hint": True, "tool_gap": ToolGap("const", 0.0)}, "(0 s), which must be", id="zero-hint"),
        pytest.param({"resume_hint": True, "tool_gap": ToolGap("const", 2000.0)}, "(4000 s)", id="hint-too-long"),
    ],
)
def test_an_agent_config_refuses_values_it_cannot_run(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _agent(**fields)
    assert message in str(caught.value)


def test_agent_sessions_refuse_the_other_workloads_and_load_flags() -> None:
    with pytest.raises(ConfigError, match="drop --turns, --num-prefixes"):
        WorkloadConfig(turns=2, num_prefixes=3, agent=_agent())
    with pytest.raises(ConfigError, match="--agent-sessions sets the load"):
        BenchConfig(load=LoadConfig(concurrency=4, num_requests=4), workload=WorkloadConfig(agent=_agent()))


##### figures by call #####


def _metrics(turn: int, ttft: float, prompt: int, cached: int | None, ok: bool = True) -> RequestMetrics:
    return RequestMetrics(
        is_ok=ok,
        error=None if ok else "HTTP 500: x",
        start=0.0,
        end=1.0,
        ttft=ttft,
        e2e=1000.0,
        itl=None,
        tpot=None,
        chunk_gaps=(),
        input_tokens=prompt,
        output_tokens=3,
        has_usage=True,
        cached_tokens=cached,
        turn=turn,
    )


def test_call_figures_split_call_one_from_later_calls_with_exact_percentiles_and_hit_rates() -> None:
    metrics = [
        _metrics(0, 100.0, 1000, 0),
        _metrics(0, 200.0, 1000, 100),
        _metrics(1, 10.0, 2000, 1500),
        _metrics(2, 20.0, 3000, 2500),
        _metrics(3, 30.0, 4000, None),  # told no cached count: not in the hit rate, still in TTFT
        _metrics(3, 999.0, 4000, 4000, ok=False),  # failed: in the requests only
    ]
    first, later = call_figures(metrics, calls=4)
    assert (first.calls, first.num_requests, first.num_completed) == ("1", 2, 2)
    assert (first.ttft_p50, first.ttft_p90) == (150.0, 190.0)
    assert first.cache_hit_rate == pytest.approx(100 / 2000)
    assert (later.calls, later.num_requests, later.num_completed) == ("2..4", 4, 3)
    assert (later.ttft_p50, later.ttft_p90) == (20.0, 28.0)
    assert (later.prompt_tokens, later.cached_tokens) == (5000, 4000) and later.cache_hit_rate == 0.8
    assert call_figures([_metrics(0, 5.0, 10, None)], calls=1)[0].cache_hit_rate is None


##### runs #####


async def test_an_agent_run_sends_each_sessions_calls_a_gap_apart_and_reports_hit_rates_by_call(serve) -> None:
    rhythm = Rhythm(ttft_s=0.0, gap_s=0.0, prefix_cache=True)
    agent = _agent(sessions=3, calls=4, tool_gap=parse_gap("const:0.05"), resume_hint=True)
    async with serve(rhythm) as url:
        config = BenchConfig(
            url=url,
            load=LoadConfig(num_requests=12),
            tokenizer="none",
            workload=WorkloadConfig(osl=3, agent=agent),
        )
        result = await run_bench(config)
    run = result.runs[0]
    assert run.summary.num_completed == 12 and len(rhythm.bodies) == 13  # the probe, then 3 sessions × 4 calls
    sessions = [h.get(SESSION_HEADER) for h in rhythm.headers[1:]]
    assert sorted(set(sessions)) == ["agent-0-0", "agent-0-1", "agent-0-2"] and all(
        sessions.count(s) == 4 for s in sessions
    )
    by_session: dict[str, list[int]] = {}
    for index, name in enumerate(sessions, start=1):
        by_session.setdefault(name, []).append(index)
    for posts in by_session.values():
        hinted = ["nvext" in rhythm.bodies[i] for i in posts]
        assert hinted == [True, True, True, False]
        for before, after in zip(posts, posts[1:], strict=False):
            assert rhythm.arrivals[after] - rhythm.ends[before] >= 0.045  # the tool gap, after the reply
    # each later call finds exactly its session's previous prompt cached: the fake's prefix cache counts words
    words = [len(prompt_words(body)) for body in rhythm.bodies]
    cached = sum(words[before] for posts in by_session.values() for before in posts[:-1])
    prompted = sum(words[after] for posts in by_session.values() for after in posts[1:])
    first, rest = run.calls
    assert (first.calls, first.num_completed, first.cache_hit_rate) == ("1", 3, 0.0)
    assert (rest.calls, rest.num_completed) == ("2..4", 9)
    assert rest.cache_hit_rate == pytest.approx(cached / prompted)
    assert 0.5 < rest.cache_hit_rate < 1.0


def test_the_cli_runs_every_call_of_every_session_and_writes_the_figures_by_call(serve_in_thread, tmp_path) -> None:
    out = tmp_path / "agents.json"
    args = ["--agent-sessions", "2", "--agent-calls", "3", "--agent-tool-gap", "const:0.01", "--json", str(out)]
    with serve_in_thread(Rhythm(ttft_s=0.0, gap_s=0.0, prefix_cache=True)) as url:
        result = CliRunner().invoke(app, ["--url", url, *FAST, "--agent-system-len", "30", *args])
    assert result.exit_code == 0, result.output
    assert "agent sessions, by call" in result.output and "2..3" in result.output
    document = json.loads(out.read_text())
    assert document["summary"]["num_completed"] == 6  # no -n: 2 sessions × 3 calls
    assert [c["calls"] for c in document["agent"]["calls"]] == ["1", "2..3"]
    assert [c["num_completed"] for c in document["agent"]["calls"]] == [2, 4]
    assert document["info"]["workload"]["agent"]["tool_gap"] == "const:0.01"


def test_a_bad_tool_gap_on_the_command_line_fails_with_its_one_line() -> None:
    result = CliRunner().invoke(
        app, ["--url", "http://127.0.0.1:1", "--agent-sessions", "2", "--agent-tool-gap", "exp:-2"]
    )
    assert isinstance(result.exception, ConfigError)
    assert str(result.exception).startswith("--agent-tool-gap 'exp:-2': '-2' is not a number of seconds >= 0")
