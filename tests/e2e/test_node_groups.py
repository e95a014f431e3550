"""One engine over several nodes: `dyn serve --nodes-per-worker 2` runs each worker as a leader and a headless
follower (the mocker's multi-node mode), which live, die and restart together."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import DynProcess, descendants
from tests.e2e.test_fault_tolerance import CHAT, read_stream

GROUPS = ("--engine", "mocker", "--speedup-ratio", "1", "--lease-ttl", "2", "--nodes-per-worker", "2")


def group_members(d: DynProcess) -> dict[str, tuple[int, int]]:
    """Leader address -> (leader pid, follower pid), read from the config documents of `dyn serve`'s children."""
    leaders: dict[str, int] = {}
    followers: dict[str, int] = {}
    for pid in descendants(d.proc.pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if b"dynamo_cli.cli.main" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue  # a process a worker started (a follower's watchdog) inherits its environment
        except OSError:
            continue
        document = next((e[len(b"DYN_WORKER_CONFIG=") :] for e in environ if e.startswith(b"DYN_WORKER_CONFIG=")), None)
        if document is None:
            continue
        group = json.loads(document)["group"]
        (followers if group["node_rank"] else leaders)[group["leader_addr"]] = pid
    return {addr: (pid, followers[addr]) for addr, pid in leaders.items() if addr in followers}


def instances(d: DynProcess) -> dict[str, str]:
    """Registered worker instance (hex) -> its address."""
    return {f"{r.instance_id:x}": r.address for r in d.instance_records() if r.role != "router"}


def wait_for(predicate, timeout: float, what: str) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            pytest.fail(f"{what} not within {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - start


def test_only_leaders_register_and_a_killed_follower_takes_its_group_out_at_once_and_back_whole(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    d: DynProcess = dyn_serve(*GROUPS, "--workers", "2")
    registered = instances(d)
    groups = group_members(d)
    assert len(registered) == 2 and sorted(registered.values()) == sorted(groups)  # the leaders, on their addresses
    with httpx.Client(base_url=d.url, headers=d.auth, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 300}) as r:
            victim = r.headers["x-worker-instance-id"]
            _, follower = groups[registered[victim]]
            gone_in: list[float] = []

            def kill_follower(n: int) -> None:
                if n == 20:
                    os.kill(follower, signal.SIGKILL)
                    gone_in.append(wait_for(lambda: victim not in instances(d), 5, "the broken group out of discovery"))

            result = read_stream(r, kill_follower)
        metrics = http.get("/metrics").text
    assert gone_in[0] < 1.0, gone_in  # out of routing within a second of the follower's death
    assert result["errors"] == [] and result["usage"]["completion_tokens"] == 300  # migrated, nothing lost
    assert 'migration_type="ongoing_request",model="smollm2"} 1.0' in metrics
    # the group restarts as a unit: a new leader with a new follower, joined, registered
    wait_for(lambda: len(instances(d)) == 2 and len(group_members(d)) == 2, 30, "the restarted group")
    assert follower not in {f for _, f in group_members(d).values()}


def test_a_killed_leader_ends_its_follower_and_the_group_restarts(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    d: DynProcess = dyn_serve(*GROUPS, "--workers", "1")
    ((address, (leader, follower)),) = group_members(d).items()
    old = set(instances(d))
    os.kill(leader, signal.SIGKILL)
    wait_for(lambda: not _alive(follower), 5, "the follower's exit")
    wait_for(lambda: instances(d) and not old & set(instances(d)), 30, "the restarted group's leader")
    assert group_members(d)[address][1] != follower


def test_a_follower_without_its_leader_gives_up_with_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    argv = [sys.executable, "-m", "dynamo_cli.cli.main", "worker", "--engine", "mocker", "--nnodes", "2"]
    argv += ["--node-rank", "1", "--leader-addr", "127.0.0.1:9", "--group-join-timeout", "1"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode != 0
    assert "cannot join the leader at 127.0.0.1:9" in out.stderr and "Traceback" not in out.stderr


def test_a_group_flag_that_cannot_work_is_refused_naming_it() -> None:
    assert "--leader-addr" in start_dyn_fails("worker", "--engine", "mocker", "--nnodes", "2")
    one_node = ("worker", "--engine", "llamacpp", "--nnodes", "2", "--leader-addr", "127.0.0.1:9")
    assert "--engine llamacpp runs on one node" in start_dyn_fails(*one_node)  # the leader too: none could follow


def start_dyn_fails(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "dynamo_cli.cli.main", *args], capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0
    return out.stderr


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
