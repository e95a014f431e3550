"""The frontend's garbage collector stays out of the way of a steady load (runtime/supervisor.py
`freeze_heap`): requests are freed by reference counting, so young collections, each of which stalls the
event loop and walks every request in flight, stay rare; /metrics counts them."""

from __future__ import annotations

import concurrent.futures
import random
import re

import httpx

from tests.conftest import DynProcess


def _collections(d: DynProcess) -> dict[str, float]:
    text = httpx.get(f"{d.url}/metrics", timeout=10).text
    return {gen: float(n) for gen, n in re.findall(r'python_gc_collections_total\{generation="(\d)"\} (\S+)', text)}


def test_four_hundred_long_prompts_cost_the_frontend_almost_no_young_collections(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    d: DynProcess = dyn_serve("--engine", "mocker", "--workers", "1", "--speedup-ratio", "20")
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 30_000) for _ in range(2_000)] for _ in range(8)]
    with httpx.Client(base_url=d.url, headers=d.auth, timeout=60) as http:

        def ask(i: int) -> int:
            body = {"model": "smollm2", "prompt": prompts[i % 8] + [i + 1], "max_tokens": 8, "stream": True}
            return http.post("/v1/completions", json=body).status_code

        ask(0)  # the tokenizer is loaded and the heap frozen by now
        before = _collections(d)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert list(pool.map(ask, range(400))) == [200] * 400
    after = _collections(d)
    # Python's default (a young collection once 700 more containers are alive) gave 9 here.
    assert after["0"] - before["0"] <= 2, (before, after)
    assert after["1"] == before["1"], (before, after)
