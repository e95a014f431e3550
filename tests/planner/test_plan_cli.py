"""`dyn plan` end to end: flag errors are one red line; a profile of the mocker; a dry-run planner on a
mocker deployment (its frontend found in discovery) asks for more workers under a load step and fewer after it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from dynamo_cli.planner.profile import DecodeSample, PrefillSample, Profile, load_profile, save_profile
from tests.conftest import API_KEY, DynProcess, wait_until

# Slow prefill on purpose: ~30-token prompts take ~120 ms, ~250 tokens/s per worker, so a few requests a
# second need more than one worker; decode is cheap and never the bottleneck here.
STEP_PROFILE = Profile(
    engine="mocker",
    model="smollm2",
    max_kv_tokens=1_000_000,
    max_num_seqs=256,
    prefill=[PrefillSample(isl=10, ttft_ms=100.0), PrefillSample(isl=1000, ttft_ms=1000.0)],
    decode=[
        DecodeSample(kv_usage=0.0, context_length=100, itl_ms=5.0),
        DecodeSample(kv_usage=1.0, context_length=100, itl_ms=10.0),
    ],
)


def dyn(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dynamo_cli.cli.main", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    save_profile(STEP_PROFILE, path)
    return path


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        pytest.param(["--mode", "both"], "--mode 'both'", id="a bad mode"),
        pytest.param(["--predictor", "arima"], "--predictor 'arima'", id="an unknown predictor"),
        pytest.param(["--connector", "k8s"], "--connector 'k8s'", id="an unknown connector"),
        pytest.param(["--min-workers", "3", "--max-workers", "2"], "--min-workers", id="min above max"),
        pytest.param(["--itl", "0"], "--itl must be positive", id="a zero target"),
    ],
)
def test_bad_plan_run_flags_are_one_red_line(flags: list[str], expected: str, profile_file: Path) -> None:
    base = ["plan", "run", "--profile", str(profile_file), "--ttft", "500", "--itl", "50", "--frontend", "http://x"]
    result = dyn(*base, *flags)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error:") and expected in lines[0]


def test_a_missing_profile_is_one_red_line(tmp_path: Path) -> None:
    result = dyn(
        "plan",
        "run",
        "--profile",
        str(tmp_path / "none.json"),
        "--ttft",
        "500",
        "--itl",
        "50",
        "--frontend",
        "http://x",
    )
    assert result.returncode != 0 and "cannot be read" in result.stderr and "dyn plan profile" in result.stderr


def test_bad_sweep_flags_are_one_red_line(tmp_path: Path) -> None:
    result = dyn("plan", "profile", "--out", str(tmp_path / "p.json"), "--isls", "128,abc")
    assert result.returncode != 0 and "--isls '128,abc'" in result.stderr and "Traceback" not in result.stderr


def test_profiling_the_mocker_writes_a_profile_that_rises_with_isl_and_usage(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    result = dyn(
        "plan",
        "profile",
        "--engine",
        "mocker",
        "--out",
        str(out),
        "--isls",
        "256,4096",
        "--contexts",
        "1024",
        "--usages",
        "0.01,0.2",
        "--speedup-ratio",
        "10",
    )
    assert result.returncode == 0, result.stderr
    profile = load_profile(out)
    assert [s.isl for s in profile.prefill] == [256, 4096] and profile.max_kv_tokens > 0
    # Dynamo's model: 256 tokens ≈ 20.6 + 6 ms, 4096 ≈ 85.8 + 6 ms: the longer prompt takes clearly longer
    assert profile.prefill[1].ttft_ms > 2 * profile.prefill[0].ttft_ms
    low, high = profile.decode
    assert low.kv_usage < high.kv_usage and low.itl_ms >= 5.0  # never faster than the model's 5.74 ms floor


def _load(url: str, seconds: float, stop: threading.Event, failures: list[int] | None = None) -> None:
    """Closed-loop load of short completions from 8 threads for `seconds`; failed statuses go to `failures`."""

    def client() -> None:
        deadline = time.monotonic() + seconds
        with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            while time.monotonic() < deadline and not stop.is_set():
                body = {"model": "smollm2", "prompt": "hello " * 20, "max_tokens": 4}
                status = http.post(f"{url}/v1/completions", json=body).status_code
                if status != 200 and failures is not None:
                    failures.append(status)

    threads = [threading.Thread(target=client) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _decode_counts(stdout: str) -> list[int]:
    """The decode (agg: pool) target of every printed decision."""
    return [
        int(line.split("decode ")[1].split("→")[1].split(" ")[0])
        for line in stdout.splitlines()
        if line.startswith("decision ")
    ]


def _wait_lines(lines: list[str], count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len([line for line in lines if line.startswith("decision ")]) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_dry_run_planner_scales_up_under_a_load_step_and_back_down(dyn_serve, profile_file: Path) -> None:  # type: ignore[no-untyped-def]
    frontend: DynProcess = dyn_serve("--engine", "mocker", "--workers", "1", "--speedup-ratio", "50")
    planner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dynamo_cli.cli.main",
            "plan",
            "run",
            "--profile",
            str(profile_file),
            "--ttft",
            "1000",
            "--itl",
            "50",
            "--mode",
            "agg",
            "--interval",
            "1",
            "--load-interval",
            "0",
            "--max-workers",
            "16",
            "--discovery",
            frontend.discovery,
            "--dry-run",
        ],  # no --frontend: found in discovery
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    assert planner.stdout is not None
    threading.Thread(target=lambda: lines.extend(planner.stdout), daemon=True).start()  # type: ignore[arg-type]
    try:
        _wait_lines(lines, 1, 60)  # one idle interval first
        before = len(lines)
        _load(frontend.url, 3.0, threading.Event())
        during = len(lines)
        _wait_lines(lines, during + 2, 30)  # two idle intervals after the step, or more until back to 1
        deadline = time.monotonic() + 30  # the burst logic holds what the load's trend needed for a while
        while _decode_counts("".join(lines))[-1] != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        planner.terminate()
        _, err = planner.communicate(timeout=30)
    counts = _decode_counts("".join(lines))
    assert planner.returncode == 0, err
    assert counts[0] == 1, lines  # idle: the minimum
    assert max(counts[before : during + 1]) >= 2, lines  # the step: more workers within the loaded intervals
    assert counts[-1] == 1, lines  # idle again: back to the minimum


def test_a_local_planner_starts_workers_for_a_load_step_and_drains_them_after(dyn_serve, profile_file: Path) -> None:  # type: ignore[no-untyped-def]
    secret = {"DYN_CLUSTER_SECRET": "ab" * 32}
    frontend: DynProcess = dyn_serve("--engine", "mocker", "--workers", "0", env=secret)
    planner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dynamo_cli.cli.main",
            "plan",
            "run",
            "--profile",
            str(profile_file),
            "--ttft",
            "1000",
            "--itl",
            "50",
            "--mode",
            "agg",
            "--interval",
            "1",
            "--load-interval",
            "0",
            "--max-workers",
            "3",
            "--discovery",
            frontend.discovery,
            "--connector",
            "local",
            "--engine",
            "mocker",
            "--speedup-ratio",
            "50",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **secret},
    )
    sizes: list[int] = []
    failures: list[int] = []
    missed = ""
    try:
        if not wait_until(lambda: len(frontend.serving_pids()) == 1, 60):
            missed = "the planner did not start the minimum"
        else:
            loader = threading.Thread(target=_load, args=(frontend.url, 8.0, threading.Event(), failures))
            loader.start()
            while loader.is_alive():
                sizes.append(len(frontend.serving_pids()))
                time.sleep(0.3)
            if not wait_until(lambda: len(frontend.serving_pids()) == 1, 30):
                missed = "the planner did not scale back down"
    finally:
        planner.terminate()
        _, err = planner.communicate(timeout=60)
    # All of it on any failure: this test has failed now and then on fresh clones.
    told = f"sizes {sizes}, failures {failures}; the planner's stderr:\n{err[-4000:]}"
    assert not missed, f"{missed}; {told}"
    assert planner.returncode == 0, told
    assert sizes and max(sizes) >= 2, told
    assert failures == [], told  # no request failed while workers came and went
    assert wait_until(lambda: frontend.serving_pids() == [], 30)  # the planner's workers went with it


def test_plan_run_builds_its_workers_from_the_worker_settings(profile_file: Path) -> None:
    """`dyn plan run`'s workers take `dyn worker`'s own settings (one declaration): an engine option, a KV tier,
    the log format and the planes reach each pool's config document, with the pool's role."""
    import typer

    from dynamo_cli.cli import plan
    from dynamo_cli.config import WorkerConfig, config_document
    from dynamo_cli.engine import Role

    group = typer.main.get_command(plan.app)
    args = ["--profile", str(profile_file), "--ttft", "500", "--itl", "50", "--mode", "disagg"]
    args += ["--max-num-seqs", "7", "--kv-host-cache-gb", "2", "--log-format", "json", "--namespace", "team-a"]
    args += ["--lease-ttl", "4", "--graceful-shutdown", "9", "--engine", "mocker"]
    context = group.get_command(None, "run").make_context("run", args)  # type: ignore[union-attr]
    run = plan.plan_run(dict(context.params))
    assert (run.namespace, run.lease_ttl, run.grace_s) == ("team-a", 4.0, 9.0)
    assert run.decode is not None and run.prefill is not None
    decode = config_document(WorkerConfig, run.decode.env)
    prefill = config_document(WorkerConfig, run.prefill.env)
    assert decode is not None and prefill is not None
    assert (decode.role, decode.component, prefill.role, prefill.component) == (
        Role.DECODE,
        "backend",
        Role.PREFILL,
        "prefill",
    )
    for worker in (decode, prefill):
        assert worker.extra["max_num_seqs"] == 7
        assert worker.kv_tiers.host_bytes == 2 * 10**9
        assert worker.telemetry.log_format == "json"
        assert (worker.namespace, worker.planes.lease_ttl, worker.graceful_shutdown_s) == ("team-a", 4.0, 9.0)
        assert worker.telemetry.system_port is None  # --system-port is the planner's own


def test_plan_run_scales_the_deployments_dyn_k8s_render_writes_by_default(profile_file: Path) -> None:
    """One namespace and name rule: without --k8s-* names the connector scales render's defaults."""
    import typer

    from dynamo_cli.cli import plan

    run = typer.main.get_command(plan.app).get_command(None, "run")  # type: ignore[union-attr]
    for mode, decode, prefill in (("agg", "dyn-worker", None), ("disagg", "dyn-decode", "dyn-prefill")):
        args = ["--profile", str(profile_file), "--ttft", "500", "--itl", "50", "--mode", mode]
        context = run.make_context("run", [*args, "--connector", "kubernetes"])
        kubernetes = plan.plan_run(dict(context.params)).kubernetes
        assert kubernetes is not None
        assert (kubernetes.namespace, kubernetes.decode_deployment, kubernetes.prefill_deployment) == (
            "dyn",
            decode,
            prefill,
        )
