"""`dyn serve --planner`: the planner in the serving process scales the deployment's own workers under a load
step, and no request fails while they come and go."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

from tests.conftest import DynProcess, descendants, wait_until
from tests.planner.test_plan_cli import _load, dyn, profile_file  # noqa: F401  (profile_file: a fixture)


def test_serve_with_the_planner_adds_workers_under_a_load_step_and_drains_them_after(
    dyn_serve,  # type: ignore[no-untyped-def]
    profile_file: Path,  # noqa: F811
) -> None:
    deployment: DynProcess = dyn_serve(
        "--engine",
        "mocker",
        "--speedup-ratio",
        "50",
        "--workers",
        "1",
        "--planner",
        "--planner-profile",
        str(profile_file),
        "--planner-ttft",
        "1000",
        "--planner-itl",
        "50",
        "--planner-interval",
        "1",
        "--planner-load-interval",
        "0",
        "--planner-max-workers",
        "3",
    )
    assert len(deployment.serving_pids()) == 1
    failures: list[int] = []
    stop = threading.Event()
    # the load lasts until the added workers serve (their startup under load on 2 cores is 3-5 s), then 2 s more
    loader = threading.Thread(target=_load, args=(deployment.url, 40.0, stop, failures))
    loader.start()
    sizes: list[int] = []
    while loader.is_alive() and (max(sizes, default=0) < 2 or len(sizes) < sizes.index(max(sizes)) + 7):
        sizes.append(len(deployment.serving_pids()))
        time.sleep(0.3)
    stop.set()
    loader.join()
    assert max(sizes) >= 2, sizes  # discovery shows the workers the planner added
    decisions = [line for line in deployment.lines if " INFO dynamo_cli.planner.planner: decision " in line]
    # logged as `dyn plan run` prints them, with the inputs behind each: what was observed and forecast
    assert any(re.search(r"decode 1→[23] \[applied\]: .+; observed Observation\(.+; forecast ", d) for d in decisions)
    assert failures == []  # no request failed while workers came and went
    assert wait_until(lambda: len(deployment.serving_pids()) == 1, 30), "the planner did not scale back down"
    workers = descendants(deployment.proc.pid)
    assert deployment.stop() == 0
    assert wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in workers), 15)


def test_the_planner_needs_a_profile_for_an_engine_it_cannot_profile_on_the_fly(tmp_path: Path) -> None:
    result = dyn(
        "serve",
        "--engine",
        "llamacpp",
        "--planner",
        "--planner-ttft",
        "500",
        "--planner-itl",
        "50",
        "--discovery",
        f"file://{tmp_path}/d",
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and len(lines) == 1 and "--planner-profile FILE" in lines[0], result.stderr


def test_the_planners_targets_are_checked_as_dyn_plan_run_checks_them(tmp_path: Path) -> None:
    result = dyn(
        "serve", "--engine", "mocker", "--planner", "--planner-itl", "50", "--discovery", f"file://{tmp_path}/d"
    )
    assert result.returncode != 0 and "--ttft and --itl must be positive" in result.stderr, result.stderr
