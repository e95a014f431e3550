"""Data-parallel ranks end to end: a mocker worker of several ranks is that many routing targets."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from dynamo_cli.top.snapshot import parse_snapshot
from tests.conftest import DynProcess
from tests.e2e.test_fault_tolerance import pid_of, read_stream

RANKS4 = ("--engine-arg", "data_parallel_size=4")
FLAGS = ("--engine", "mocker", "--router", "kv", "--speedup-ratio", "20", "--lease-ttl", "2")
EXPLAIN = {"x-dyn-explain-route": "1"}
SYSTEMS = [f"You are assistant number {i}, careful and brief. " * 50 for i in range(4)]  # ~500 tokens each


def ask(http: httpx.Client, system: str, question: str) -> tuple[str, int, dict]:  # type: ignore[type-arg]
    body = {
        "model": "smollm2",
        "max_tokens": 2,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }
    r = http.post("/v1/chat/completions", json=body, headers={"x-dyn-explain-route": "1"})
    assert r.status_code == 200, r.text
    return r.headers["x-worker-instance-id"], int(r.headers["x-dyn-dp-rank"]), json.loads(r.headers["x-dyn-route"])


def test_each_prefix_goes_back_to_the_rank_that_holds_it_and_only_that_rank_indexes_it(dyn_serve, planes) -> None:  # type: ignore[no-untyped-def]
    d: DynProcess = dyn_serve(*FLAGS, *RANKS4, "--workers", "1", discovery=planes[0], events=planes[1])
    with httpx.Client(base_url=d.url, headers=d.auth, timeout=30) as http:
        holders = []
        for system in SYSTEMS:
            worker, rank, _ = ask(http, system, "first question")
            holders.append(rank)
            time.sleep(0.5)  # its KV events reach the router
        assert len(set(holders)) >= 2, holders  # four targets, not one: cold prompts spread over the ranks
        for system, holder in zip(SYSTEMS, holders, strict=True):
            again, rank, route = ask(http, system, "second question")
            assert (again, rank) == (worker, holder)
            by_rank = {c["dp_rank"]: c["overlap_blocks"] for c in route["candidates"]}
            assert sorted(by_rank) == [0, 1, 2, 3] and route["dp_rank"] == holder
            assert by_rank[holder] >= 5  # its blocks are indexed on its own rank...
            assert all(by_rank[r] == 0 for r in by_rank if holders.count(r) == 0)  # ...and on no rank that ran none
        time.sleep(1.0)  # a load report after the last request
        top = parse_snapshot(http.get("/metrics").text, 0.0)  # what `dyn top` shows: a line per rank
    lines = {w.worker_id: w for w in top.workers.values()}
    assert sorted(lines) == [f"{worker}/{r}" for r in range(4)]
    assert len({w.total_blocks for w in lines.values()}) == 1 and lines[f"{worker}/0"].total_blocks > 0
    assert sum(w.num_requests for w in lines.values()) == 8  # the worker's requests, counted once
    rows = json.loads(_dyn("ls", "--json", "--discovery", d.discovery))
    assert {r["ranks"] for r in rows if r["role"] != "router"} == {"0-3"}


def test_killing_a_worker_of_two_ranks_migrates_the_streams_of_both(dyn_serve, planes) -> None:  # type: ignore[no-untyped-def]
    flags = ("--engine", "mocker", "--router", "kv", "--speedup-ratio", "1", "--lease-ttl", "2")
    d = dyn_serve(
        *flags, "--engine-arg", "data_parallel_size=2", "--workers", "2", discovery=planes[0], events=planes[1]
    )
    started = threading.Barrier(5, timeout=60)
    placed: list[tuple[str, int]] = []
    with httpx.Client(base_url=d.url, headers=d.auth, timeout=90) as http:

        def stream(i: int) -> dict:  # type: ignore[type-arg]
            body = {
                "model": "smollm2",
                "messages": [{"role": "user", "content": f"story {i}: " + SYSTEMS[i]}],
                "stream": True,
                "stream_options": {"include_usage": True},
                "max_tokens": 300,
            }
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                placed.append((r.headers["x-worker-instance-id"], int(r.headers["x-dyn-dp-rank"])))
                return read_stream(r, lambda n: n == 5 and started.wait())

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(stream, i) for i in range(4)]
            started.wait()  # every stream is under way (five tokens each)
            workers = [worker for worker, _ in placed]
            victim = max(set(workers), key=workers.count)
            os.kill(pid_of(d, victim), signal.SIGKILL)
            results = [f.result(timeout=90) for f in futures]
        metrics = http.get("/metrics").text
    assert sorted(placed) == sorted({(w, r) for w, r in placed}) and len(placed) == 4  # four targets, one stream each
    assert {rank for worker, rank in placed if worker == victim} == {0, 1}  # the dead worker ran one on each rank
    for result in results:
        assert result["errors"] == [] and result["usage"]["completion_tokens"] == 300
    assert 'migration_type="ongoing_request",model="smollm2"} 2.0' in metrics


def _dyn(*args: str) -> str:
    command = [sys.executable, "-m", "dynamo_cli.cli.main", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, check=True).stdout


def test_disaggregation_prefills_on_a_prefill_rank_and_decodes_on_a_decode_rank(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    flags = ("--engine", "mocker", "--router", "kv", "--speedup-ratio", "5", "--disagg", "--disagg-policy", "always")
    d: DynProcess = dyn_serve(*flags, "--engine-arg", "data_parallel_size=2", "--lease-ttl", "2")
    body = {"model": "smollm2", "max_tokens": 8, "ignore_eos": True}
    with httpx.Client(base_url=d.url, headers=d.auth, timeout=60) as http:
        seen = []
        for question in ("first", "second"):
            messages = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": question}]
            r = http.post("/v1/chat/completions", json={**body, "messages": messages}, headers=EXPLAIN)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
            prefill = json.loads(r.headers["x-dyn-prefill-route"])
            assert prefill["outcome"] == "remote"
            seen.append((prefill["prefill_route"]["dp_rank"], prefill["prefill_route"]["overlap_blocks"]))
            assert int(r.headers["x-dyn-dp-rank"]) == json.loads(r.headers["x-dyn-route"])["dp_rank"] in (0, 1)
            time.sleep(0.5)  # the prefill rank's KV events reach the router
    (first_rank, _), (second_rank, overlap) = seen
    assert second_rank == first_rank and overlap >= 5  # the prefix went back to the prefill rank that holds it


def test_behind_a_dyn_router_the_router_chooses_the_rank(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    flags = ("--engine", "mocker", "--speedup-ratio", "20", "--router", "remote", "--routers", "1", "--lease-ttl", "2")
    d: DynProcess = dyn_serve(*flags, *RANKS4, "--workers", "1")
    body = {"model": "smollm2", "max_tokens": 2, "messages": [{"role": "system", "content": SYSTEMS[1]}]}
    with httpx.Client(base_url=d.url, headers=d.auth, timeout=60) as http:
        cached = []
        for question in ("first", "second", "third"):
            messages = [*body["messages"], {"role": "user", "content": question}]  # type: ignore[misc]
            r = http.post("/v1/chat/completions", json={**body, "messages": messages})
            assert r.status_code == 200, r.text
            assert "x-dyn-dp-rank" not in r.headers  # the frontend routed to a router, which chose the rank
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            time.sleep(0.5)
    assert cached[0] == 0 and min(cached[1:]) >= 5 * 64  # the router sent the prefix back to the rank holding it


def test_a_router_blind_to_the_ranks_hits_the_cache_less_than_one_that_sees_them(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    hidden = ("--engine-arg", "data_parallel_hidden=true")
    modes: dict[str, tuple[str, ...]] = {"aware": (), "blind": hidden}
    cached = {name: _cached_share(dyn_serve(*FLAGS, *RANKS4, *extra)) for name, extra in modes.items()}
    assert cached["aware"] >= 0.6 and cached["aware"] > cached["blind"] + 0.2, cached


def _cached_share(d: DynProcess) -> float:
    """Four prompts sent four times, four at once in a shuffled order each time: the share of prompt tokens cached."""
    import random

    rng, order = random.Random(5), list(range(4))
    totals = [0, 0]
    with httpx.Client(base_url=d.url, headers=d.auth, timeout=60) as http:

        def send(i: int) -> tuple[int, int]:
            messages = [{"role": "system", "content": SYSTEMS[i]}, {"role": "user", "content": "go"}]
            r = http.post("/v1/chat/completions", json={"model": "smollm2", "max_tokens": 16, "messages": messages})
            usage = r.json()["usage"]
            return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for _ in range(4):
                rng.shuffle(order)
                for hit, total in pool.map(send, order):
                    totals[0], totals[1] = totals[0] + hit, totals[1] + total
                time.sleep(0.5)  # the round's KV events reach the router
    d.stop()
    return totals[0] / totals[1]
