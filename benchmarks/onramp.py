"""dyn's router in front of engine servers it did not start (`dyn serve --backend URL --backend URL`), against the
client spreading its requests over the same servers itself (what a plain load balancer does).

The servers are two `dyn serve --engine mocker` deployments reached only over HTTP (their own namespaces), each with
a KV cache of `--blocks` blocks: under cache pressure, the shared-prefix workload's prefixes do not all fit on one
server. Sides, alternated in each round, one request at a time (streamed; TTFT = the first non-empty piece):
    direct_rr, direct_rr_again   the client round-robins over the two servers (A/A: the noise floor)
    dyn_kv                       through one front, `--router kv` (approximate: the servers publish no KV events)
    dyn_rr                       through a second front, `--router round-robin`: what the front adds, routing aside
Prints TTFT p50/p90 and e2e p50/p99 per side, and each side's TTFT p50 over direct_rr's.

With `--servers vllm` the servers are two real vLLM CPU servers (`python -m vllm.entrypoints.openai.api_server`, the
built-in SmolLM2 exported to an HF directory, prefix caching on, a KV cache of `--blocks` 128-token blocks each) that
publish their KV events over ZMQ, and the dyn sides are:
    dyn_kv_events                `--router kv` with each backend's events (`--backend URL,kv_events=...,kv_replay=...`)
    dyn_kv_approx                `--router kv` without them (approximate)

    python benchmarks/onramp.py [--rounds 3] [--requests 48] [--groups 8] [--blocks 400] [--json PATH]
    python benchmarks/onramp.py --servers vllm --blocks 40 --rounds 2 --requests 24
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import free_port, loadavg, serving, write_results  # noqa: E402

MODEL = "mock"
WORDS = "river mountain city garden window letter music paper silver winter morning story bridge ocean field".split()


def _prefixes(groups: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Group {g}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for g in range(groups)]


def _once(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> tuple[float, float]:
    """(TTFT ms, e2e ms) of one streamed completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    start, first = time.perf_counter(), None
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                first = time.perf_counter()
    end = time.perf_counter()
    return ((first or end) - start) * 1e3, (end - start) * 1e3


def _round_robin(urls: list[str]) -> Iterator[str]:
    while True:
        yield from urls


def _summary(times: list[tuple[float, float]], base: float | None) -> dict[str, Any]:
    ttft, e2e = [t for t, _ in times], [e for _, e in times]
    p50 = statistics.median(ttft)
    return {
        "ttft_p50_ms": p50,
        "ttft_p90_ms": float(np.percentile(ttft, 90)),
        "e2e_p50_ms": statistics.median(e2e),
        "e2e_p99_ms": float(np.percentile(e2e, 99)),
        "ttft_p50_over_direct": p50 / base if base else 1.0,
        "n": len(times),
    }


def _rounds(
    args: argparse.Namespace, client: httpx.Client, servers: list[str], fronts: dict[str, str], names: tuple[str, ...]
) -> dict[str, list[tuple[float, float]]]:
    """Each side's (TTFT, e2e) samples, the sides alternated in each round: a side named in `fronts` goes through
    that front, the others round-robin over `servers` themselves."""
    prefixes, rng, spread = _prefixes(args.groups, args.prefix_words), random.Random(1), _round_robin(servers)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            prompts = [f"{rng.choice(prefixes)} Question {rng.random():.9f}?" for _ in range(args.requests)]
            samples[name] += [_once(client, fronts.get(name) or next(spread), p, args.max_tokens) for p in prompts]
    return samples


def _measure(args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """Each side's (TTFT, e2e) samples, the sides alternated in each round."""
    tmp = Path(tempfile.mkdtemp())
    server = ["--engine", "mocker", "--served-model-name", MODEL, "--speedup-ratio", args.speedup]
    server += ["--num-gpu-blocks", str(args.blocks)]
    names = ("direct_rr", "dyn_kv", "dyn_rr", "direct_rr_again")
    with (
        serving([*server, "--namespace", "onramp-a"], tmp / "a.log") as a,
        serving([*server, "--namespace", "onramp-b"], tmp / "b.log") as b,
    ):
        backends = ["--backend", a.url, "--backend", b.url, "--model", "smollm2"]
        with (
            serving([*backends, "--router", "kv"], tmp / "kv.log") as kv,
            serving([*backends, "--router", "round-robin"], tmp / "rr.log") as rr,
            httpx.Client(timeout=60) as client,
        ):
            return _rounds(args, client, [a.url, b.url], {"dyn_kv": kv.url, "dyn_rr": rr.url}, names)


KV_BYTES_PER_TOKEN = 23040
"""SmolLM2-135M's KV cache per token in vLLM's CPU build (30 layers x 3 KV heads x 64 x K and V x 2 bytes)."""


@contextlib.contextmanager
def _vllm(where: Path, blocks: int) -> Iterator[tuple[str, str]]:
    """A vLLM CPU server with `blocks` 128-token KV blocks, its events on ipc endpoints: (its URL, its --backend)."""
    from dyn_engines.hf_export import hf_model_dir

    from benchmarks.engine_vllm import Server

    port, events, replay = free_port(), f"ipc://{where}-events", f"ipc://{where}-replay"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events, "replay_endpoint": replay}
    flags = ["--model", hf_model_dir("smollm2"), "--served-model-name", MODEL, "--port", str(port)]
    flags += ["--enforce-eager", "--max-num-seqs", "8", "--max-model-len", "4096", "--enable-prefix-caching"]
    flags += [
        "--kv-cache-memory-bytes",
        str(blocks * 128 * KV_BYTES_PER_TOKEN),
        "--kv-events-config",
        json.dumps(config),
    ]
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *flags]
    server = Server("vllm serve", argv, f"http://127.0.0.1:{port}", re.compile(r"Application startup complete"))
    try:
        server.wait_ready(300)
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port},kv_events={events},kv_replay={replay}"
    finally:
        server.stop()


def _measure_vllm(args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """As `_measure`, with two vLLM servers: their events against approximate routing."""
    tmp = Path(tempfile.mkdtemp())
    names = ("direct_rr", "dyn_kv_events", "dyn_kv_approx", "direct_rr_again")
    with _vllm(tmp / "a", args.blocks) as (a, a_events), _vllm(tmp / "b", args.blocks) as (b, b_events):
        events = ["--backend", a_events, "--backend", b_events, "--model", "smollm2", "--router", "kv"]
        approx = ["--backend", a, "--backend", b, "--model", "smollm2", "--router", "kv"]
        with (
            serving([*events, "--namespace", "onramp-events"], tmp / "events.log") as front_events,
            serving([*approx, "--namespace", "onramp-approx"], tmp / "approx.log") as front_approx,
            httpx.Client(timeout=120) as client,
        ):
            fronts = {"dyn_kv_events": front_events.url, "dyn_kv_approx": front_approx.url}
            return _rounds(args, client, [a, b], fronts, names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=48, help="per side per round")
    parser.add_argument("--groups", type=int, default=8, help="shared prefixes")
    parser.add_argument("--prefix-words", type=int, default=700)
    parser.add_argument("--blocks", type=int, default=400, help="each server's KV blocks")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--speedup", default="1")
    parser.add_argument("--servers", choices=("mocker", "vllm"), default="mocker")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    start_load = loadavg()
    samples = _measure_vllm(args) if args.servers == "vllm" else _measure(args)
    base = statistics.median(t for t, _ in samples["direct_rr"])
    rows = {name: _summary(times, base) for name, times in samples.items()}
    print(f"{'side':<16} {'ttft p50':>9} {'ttft p90':>9} {'e2e p50':>8} {'e2e p99':>8} {'ttft p50 / direct':>18}")
    for name, r in rows.items():
        print(
            f"{name:<16} {r['ttft_p50_ms']:9.1f} {r['ttft_p90_ms']:9.1f} {r['e2e_p50_ms']:8.1f} "
            f"{r['e2e_p99_ms']:8.1f} {r['ttft_p50_over_direct']:18.2f}"
        )
    settings = {k: getattr(args, k) for k in ("servers", "groups", "prefix_words", "blocks", "max_tokens", "speedup")}
    write_results("onramp", {"settings": settings, "sides": rows}, args.json, loadavg_start=start_load)


if __name__ == "__main__":
    main()
