"""End to end against the rhythm server: first token after 50 ms, then one every 10 ms.

Tolerances: the server cannot send early, so latencies have a hard floor at the rhythm; the ceilings
allow scheduling noise on two busy shared cores (TTFT +30 ms, ITL +4 ms, e2e +40 ms at the median).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from sse_server import Rhythm

from dynamo_cli.bench.load import LoadConfig, parse_model_mix
from dynamo_cli.bench.metrics import parse_slo
from dynamo_cli.bench.session import BenchConfig, WorkloadConfig, run_bench
from dynamo_cli.errors import ConfigError

OSL = 8
E2E_MS = 50 + 10 * (OSL - 1)  # 120 ms


def _config(url: str, **load: object) -> BenchConfig:
    workload = WorkloadConfig(isl=16, osl=OSL)
    return BenchConfig(url=url, load=LoadConfig(**load), workload=workload, tokenizer="none")  # type: ignore[arg-type]


async def test_ttft_itl_e2e_and_throughput_match_the_servers_rhythm(serve) -> None:
    async with serve(Rhythm(ttft_s=0.05, gap_s=0.01)) as url:
        result = await run_bench(_config(url, concurrency=4, num_requests=16))
    s = result.runs[0].summary
    lat = s.latency
    assert s.num_completed == 16 and s.num_failed == 0
    assert 50.0 <= lat["ttft"].p50 <= 80.0
    assert 9.5 <= lat["itl"].p50 <= 14.0
    assert 9.0 <= lat["chunk_gap"].p50 <= 14.0
    assert E2E_MS <= lat["e2e"].p50 <= E2E_MS + 40
    assert lat["output_tokens"].mean == OSL and s.output_tokens_source == "usage"
    # 4 rounds of 4 concurrent requests, each ≈ 120 ms long
    assert s.request_throughput == pytest.approx(16 / s.duration_s)
    assert 4 * E2E_MS / 1e3 <= s.duration_s <= 4 * (E2E_MS + 50) / 1e3
    assert s.output_token_throughput == pytest.approx(16 * OSL / s.duration_s)


async def test_requests_follow_the_constant_request_rate(serve) -> None:
    rhythm = Rhythm(ttft_s=0.0, gap_s=0.0)
    async with serve(rhythm) as url:
        await run_bench(_config(url, request_rate=50, num_requests=10))
    arrivals = rhythm.arrivals[1:]  # the first POST is the probe
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert len(arrivals) == 10
    assert sum(gaps) / len(gaps) == pytest.approx(0.02, abs=0.005)


async def test_trace_replay_sends_requests_at_the_scaled_timestamps(serve, tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    stamps = [5000, 5100, 5300, 5600]  # ms; scaled by 0.5 → 0, 50, 150, 300 ms after the start
    trace.write_text(
        "\n".join(json.dumps({"timestamp": t, "input_length": 20, "output_length": 2, "hash_ids": [1]}) for t in stamps)
    )
    rhythm = Rhythm(ttft_s=0.0, gap_s=0.0)
    async with serve(rhythm) as url:
        config = BenchConfig(
            url=url,
            load=LoadConfig(num_requests=4),
            tokenizer="none",
            workload=WorkloadConfig(trace=str(trace), trace_time_scale=0.5),
        )
        await run_bench(config)
    arrivals = rhythm.arrivals[1:]
    offsets = [(t - arrivals[0]) * 1e3 for t in arrivals]
    assert offsets == pytest.approx([0, 50, 150, 300], abs=20)
    assert rhythm.bodies[1]["messages"][0]["content"] == rhythm.bodies[2]["messages"][0]["content"]


async def test_failures_are_counted_with_their_error_and_the_run_goes_on(serve) -> None:
    async with serve(Rhythm(ttft_s=0.0, gap_s=0.0, fail_every=3)) as url:
        result = await run_bench(_config(url, concurrency=1, num_requests=9))
    s = result.runs[0].summary
    # POST 1 is the probe; POSTs 3, 6, 9 fail, i.e. measured requests 2, 5, 8
    assert (s.num_requests, s.num_completed, s.num_failed) == (9, 6, 3)
    assert s.errors == {"HTTP 500: injected failure": 3}


async def test_goodput_counts_exactly_the_requests_within_the_ttft_slo(serve) -> None:
    rhythm = Rhythm(ttft_schedule=[0.0, 0.01, 0.12], gap_s=0.0)  # probe, then 10 ms, 120 ms, 0 ms, ...
    async with serve(rhythm) as url:
        config = replace(_config(url, concurrency=1, num_requests=6), slo=parse_slo(["ttft=60"]))
        result = await run_bench(config)
    s = result.runs[0].summary
    assert s.good_fraction == pytest.approx(4 / 6)
    assert s.goodput == pytest.approx(4 / s.duration_s)


async def test_warmup_requests_are_sent_but_not_measured(serve) -> None:
    rhythm = Rhythm(ttft_s=0.0, gap_s=0.0)
    async with serve(rhythm) as url:
        result = await run_bench(_config(url, concurrency=2, num_requests=5, warmup=3))
    assert len(rhythm.arrivals) == 1 + 3 + 5
    assert result.runs[0].summary.num_requests == 5


async def test_multi_turn_sessions_send_the_previous_answers_as_history(serve) -> None:
    rhythm = Rhythm(ttft_s=0.0, gap_s=0.0)
    async with serve(rhythm) as url:
        config = BenchConfig(
            url=url,
            load=LoadConfig(concurrency=1, num_requests=3),
            tokenizer="none",
            workload=WorkloadConfig(isl=5, osl=2, turns=3),
        )
        await run_bench(config)
    roles = [[m["role"] for m in body["messages"]] for body in rhythm.bodies[1:]]
    assert roles == [
        ["user"],
        ["user", "assistant", "user"],
        ["user", "assistant", "user", "assistant", "user"],
    ]
    assert rhythm.bodies[2]["messages"][1]["content"] == " tok tok"
    assert rhythm.bodies[1]["ignore_eos"] is True and rhythm.bodies[1]["stream_options"] == {"include_usage": True}


async def test_a_duration_stops_issuing_requests_in_time(serve) -> None:
    async with serve(Rhythm(ttft_s=0.02, gap_s=0.0)) as url:
        result = await run_bench(_config(url, concurrency=2, duration_s=0.3))
    s = result.runs[0].summary
    assert 5 <= s.num_requests <= 32 and s.duration_s < 0.55  # 30 ms a request at best, 0.3 s of issuing


async def test_the_completions_endpoint_sends_a_prompt_and_reads_text_chunks(serve) -> None:
    rhythm = Rhythm(ttft_s=0.0, gap_s=0.0)
    async with serve(rhythm) as url:
        config = replace(_config(url, concurrency=1, num_requests=2), endpoint="completions")
        result = await run_bench(config)
    assert "prompt" in rhythm.bodies[1] and "messages" not in rhythm.bodies[1]
    assert result.runs[0].summary.num_completed == 2
    assert result.runs[0].summary.latency["output_tokens"].mean == OSL


async def test_poisson_arrivals_average_the_asked_rate(serve) -> None:
    rhythm = Rhythm(ttft_s=0.0, gap_s=0.0)
    async with serve(rhythm) as url:
        await run_bench(_config(url, request_rate=100, arrival="poisson", num_requests=40, seed=7))
    arrivals = rhythm.arrivals[1:]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert len(arrivals) == 40
    assert 0.006 < sum(gaps) / len(gaps) < 0.025  # mean 10 ms; 39 exponential gaps vary by ~±16 %
    assert max(gaps) > 2 * min(gaps)  # not constant


async def test_a_ramp_up_starts_the_closed_loops_streams_evenly_over_it(serve) -> None:
    rhythm = Rhythm(ttft_s=0.5, gap_s=0.0)  # each stream is busy for the whole ramp: 4 requests, one per slot
    async with serve(rhythm) as url:
        await run_bench(_config(url, concurrency=4, num_requests=4, ramp_up_s=0.3))
    arrivals = rhythm.arrivals[1:]  # the first POST is the probe
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert len(arrivals) == 4
    # 0.3 s / 4 slots: starts 75 ms apart, not at once (< 5 ms apart without the ramp). Measured where the server
    # reads each request, one late read shortens the gap after it by as much: tens of ms on a loaded machine
    # (0.042 s seen there, under a full test suite), so each gap and the spread of the three are bounded loosely.
    assert all(0.03 <= gap <= 0.14 for gap in gaps), gaps
    assert 0.16 <= arrivals[-1] - arrivals[0] <= 0.32, gaps


async def test_a_zipf_model_mix_asks_each_model_about_as_often_as_its_weight(serve) -> None:
    models = ("base", "t0", "t1", "t2")
    rhythm = Rhythm(ttft_s=0.0, gap_s=0.0, models=models)
    async with serve(rhythm) as url:
        config = BenchConfig(
            url=url,
            load=LoadConfig(concurrency=8, num_requests=400),
            tokenizer="none",
            workload=WorkloadConfig(isl=8, osl=1),
            model=",".join(models),
            model_mix="zipf:1.1",
        )
        result = await run_bench(config)
    assert result.runs[0].summary.num_failed == 0 and result.info["model"] == "base,t0,t1,t2"
    asked = [body["model"] for body in rhythm.bodies[1:]]  # the first is the probe
    weights = [1 / (i + 1) ** 1.1 for i in range(4)]
    for model, weight in zip(models, weights, strict=True):
        assert abs(asked.count(model) / len(asked) - weight / sum(weights)) < 0.08, (model, asked.count(model))


def test_a_model_mix_is_checked_and_a_conversation_keeps_its_model() -> None:
    mix = parse_model_mix(["a", "b"], "uniform", seed=3)
    assert mix.weights == (1.0, 1.0) and {mix.pick("hello") for _ in range(5)} == {mix.pick("hello")}
    assert parse_model_mix(["a", "b"], "zipf:0").weights == (1.0, 1.0)
    for bad in ("zipf", "zipf:-1", "zipf:x", "pareto:1", "uniform:2"):
        with pytest.raises(ConfigError, match="--model-mix"):
            parse_model_mix(["a"], bad)
