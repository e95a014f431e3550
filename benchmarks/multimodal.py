"""Images under cache pressure: image-aware KV routing against image-blind, aggregated against E/P/D, with and
without the embedding cache.

Mocker deployments of 4 workers whose model takes images (`image_tokens=2880`, LLaVA-NeXT's five 576-token tiles,
and 20 ms of vision encoder per image not in the engine's embedding cache), driven closed loop: every request is
one shared system prompt, a short question and one image; half the images repeat one of 20 (a conversation about
one picture, a shared document scan), half are new. The 20 repeated prompts (46 blocks each) fit in the 4 workers'
640 blocks together, beside the new ones' churn, not in any one's, so where a repeated image goes decides whether
its blocks are found. TTFT p50 is also shown for the repeated and the new images apart: with half of each, the
median request sits between the two.

  aware        `--router kv`: each image's digest is in the routing view (kv/images.py)
  aware-again  the same, again: the A/A pair, the noise floor of every ratio
  blind        `--no-router-image-hashes`: the router hashes the placeholders as text, so a repeated image earns no
               credit (what a router that ignores images does)
  no-cache     aware, the embedding cache off (`image_cache_size=0`): every image not found in the prefix cache
               runs the encoder
  epd          aware plus one encode worker (`--encode-workers 1`, every image to it): E/P/D
  epd-no-cache the same with no embedding cache on the encoder either

The modes alternate in each repeat (reversed every other one). Per mode: TTFT p50/p90, req/s, the prefix-cache
hit rate (`cached_tokens` over prompt tokens), and the engines' encoder calls and embedding-cache hits (the
workers' `/metrics`). The ratios are medians over repeats, each taken within one repeat. The bar (issue 51):
blind TTFT p50 / aware TTFT p50 >= 1.3.

    python benchmarks/multimodal.py [--repeats 2] [--seconds 25] [--clients 8] [--json benchmarks/out/multimodal.json]
    python benchmarks/multimodal.py --repeats 1 --seconds 3 --warmup 1 --modes aware,blind   # a smoke run

Defaults take about 8 minutes (12 deployments of about 40 s). Traffic is 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import random
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import httpx

MODES: dict[str, tuple[str, ...]] = {
    "aware": (),
    "aware-again": (),
    "blind": ("--no-router-image-hashes",),
    "no-cache": ("--engine-arg", "image_cache_size=0"),
    "epd": ("--encode-workers", "1", "--encode-min-kb", "0"),
    "epd-no-cache": ("--encode-workers", "1", "--encode-min-kb", "0", "--engine-arg", "image_cache_size=0"),
}
"""Mode -> its `dyn serve` flags beside the common ones."""
SYSTEM = "You are a careful visual assistant. Look at the picture and answer the question in one sentence. "
COUNTERS = ("images_encoded", "image_cache_hits", "image_embeds_received")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES), help="of: " + ", ".join(MODES))
    p.add_argument("--repeats", type=int, default=2, help="runs of every mode, alternating their order")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--clients", type=int, default=8, help="closed-loop clients")
    p.add_argument("--seconds", type=float, default=25.0, help="measured window per run")
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--images", type=int, default=20, help="distinct repeated images")
    p.add_argument("--repeat-share", type=float, default=0.5, help="share of requests with a repeated image")
    p.add_argument("--image-tokens", type=int, default=2880, help="per image (LLaVA-NeXT's anyres 5 x 576)")
    p.add_argument("--image-px", type=int, default=96, help="side of the (random) square images")
    p.add_argument("--system-words", type=int, default=20, help="words of the shared system prompt")
    p.add_argument("--num-gpu-blocks", type=int, default=640, help="KV blocks per worker")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=20)
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", default=str(harness.results_path("multimodal")))
    return p.parse_args(argv)


def png_url(rng: random.Random, side: int) -> str:
    """A random (incompressible) square PNG as a data: URL."""
    from PIL import Image

    out = io.BytesIO()
    Image.frombytes("RGB", (side, side), rng.randbytes(side * side * 3)).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


class Workload:
    """The requests: a shared system prompt, a question, and a repeated or a new image."""

    def __init__(self, args: argparse.Namespace, seed: int) -> None:
        rng = random.Random(seed)
        self.args = args
        self.system = " ".join(SYSTEM.split()[i % len(SYSTEM.split())] for i in range(args.system_words))
        self.repeated = [png_url(rng, args.image_px) for _ in range(args.images)]
        self.rng = rng

    def body(self) -> tuple[dict[str, Any], bool]:
        rng, args = self.rng, self.args
        is_repeat = rng.random() < args.repeat_share
        url = rng.choice(self.repeated) if is_repeat else png_url(rng, args.image_px)
        parts = [{"type": "text", "text": "What is in this picture?"}, {"type": "image_url", "image_url": {"url": url}}]
        messages = [{"role": "system", "content": self.system}, {"role": "user", "content": parts}]
        return {"model": "smollm2", "messages": messages, "max_tokens": args.max_tokens, "stream": True}, is_repeat


async def one(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> dict[str, float] | None:
    """One streamed chat request: TTFT (first content chunk), prompt and cached tokens; None if it failed."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, usage = None, None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as reply:
            if reply.status_code != 200:
                return None
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = httpx.Response(200, content=line[6:]).json()
                if ttft is None and chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except httpx.HTTPError:
        return None
    if ttft is None or usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft": ttft, "prompt": usage["prompt_tokens"], "cached": cached}


async def closed_loop(url: str, work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """`clients` loops for warmup + seconds; the rows of requests that began inside the window."""
    rows: list[tuple[float, dict[str, float] | None, bool]] = []
    started = time.perf_counter()
    window = (started + args.warmup, started + args.warmup + args.seconds)

    async def loop(client: httpx.AsyncClient) -> None:
        while time.perf_counter() < window[1]:
            body, is_repeat = work.body()
            at = time.perf_counter()
            rows.append((at, await one(client, url, body), is_repeat))

    limits = httpx.Limits(max_connections=args.clients)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await asyncio.gather(*(loop(client) for _ in range(args.clients)))
    inside = [(r, rep) for at, r, rep in rows if window[0] <= at < window[1]]
    ok = [r for r, _ in inside if r is not None]
    ttfts = sorted(r["ttft"] for r in ok)
    repeats = [r for r, rep in inside if r is not None and rep]
    fresh = sorted(r["ttft"] for r, rep in inside if r is not None and not rep)
    return {
        "repeat_ttft_p50_ms": 1e3 * _pct(sorted(r["ttft"] for r in repeats), 0.5),
        "fresh_ttft_p50_ms": 1e3 * _pct(fresh, 0.5),
        "requests": len(ok),
        "failed": len(inside) - len(ok),
        "req_per_s": len(ok) / args.seconds,
        "ttft_p50_ms": 1e3 * _pct(ttfts, 0.5),
        "ttft_p90_ms": 1e3 * _pct(ttfts, 0.9),
        "hit_rate": sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok)),
        "repeat_hit_rate": sum(r["cached"] for r in repeats) / max(1, sum(r["prompt"] for r in repeats)),
    }


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def engine_counts(ports: list[int]) -> dict[str, float]:
    """The workers' image counters, summed."""
    totals = dict.fromkeys(COUNTERS, 0.0)
    for port in ports:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        for name in COUNTERS:
            found = re.findall(rf"^dynamo_component_engine_{name}_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
            totals[name] += sum(float(v) for v in found)
    return totals


def free_ports(n: int) -> int:
    """A base port with `n` free ports from it (the workers' system ports: `--system-port BASE`)."""
    import socket

    for _ in range(50):
        base = harness.free_port()
        try:
            for port in range(base, base + n):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise SystemExit(f"no {n} consecutive free ports")


def run_one(mode: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One deployment of `mode`, one closed-loop window."""
    import uvloop

    encoders = 1 if "--encode-workers" in MODES[mode] else 0
    base = free_ports(args.workers + encoders)
    ports = [base + i for i in range(args.workers + encoders)]
    flags = ["--engine", "mocker", "--workers", str(args.workers), "--router", "kv", "--host", "127.0.0.1"]
    flags += ["--speedup-ratio", str(args.speedup), "--block-size", str(args.block_size)]
    flags += ["--num-gpu-blocks", str(args.num_gpu_blocks), "--engine-arg", f"image_tokens={args.image_tokens}"]
    flags += ["--system-port", str(base), *MODES[mode]]
    with tempfile.TemporaryDirectory() as tmp:
        flags += ["--discovery", f"file://{tmp}/d"]
        with harness.serving(flags, Path(tmp) / "serve.log", min_instances=args.workers + encoders) as serve:
            time.sleep(1.0)  # the frontend sees every worker's KV stream
            before = engine_counts(ports)
            row = uvloop.run(closed_loop(serve.url, Workload(args, seed), args))
            after = engine_counts(ports)
    row.update({name: after[name] - before[name] for name in COUNTERS})
    row["mode"] = mode
    return row


def ratios(runs: list[dict[str, dict[str, Any]]]) -> dict[str, float]:
    """Medians over the repeats of each ratio (each taken within one repeat)."""
    out: dict[str, list[float]] = {}
    for rows in runs:
        aware = rows.get("aware")
        if aware is None:
            continue
        for other in ("aware-again", "blind", "no-cache", "epd", "epd-no-cache"):
            if other not in rows:
                continue
            for metric in ("ttft_p50_ms", "ttft_p90_ms", "repeat_ttft_p50_ms", "fresh_ttft_p50_ms"):
                name = f"{other}_over_aware_{metric.removesuffix('_ms')}"
                out.setdefault(name, []).append(rows[other][metric] / aware[metric])
    return {name: statistics.median(values) for name, values in out.items()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start_load = harness.loadavg()
    runs = harness.alternated(args.modes.split(","), args.repeats, lambda m, r: run_one(m, args, args.seed + r), _line)
    medians = ratios(runs)
    harness.print_table([{"repeat": i + 1, **_cells(row)} for i, rows in enumerate(runs) for row in rows.values()])
    harness.print_table([{"ratio": name, "median": f"{value:.2f}"} for name, value in medians.items()])
    checks = {}
    if "blind_over_aware_ttft_p50" in medians:
        checks["image_aware_1_3x_blind_ttft_p50"] = medians["blind_over_aware_ttft_p50"] >= 1.3
    print("bar:", checks)
    results = {"runs": runs, "medians": medians, "bar": checks, "args": vars(args)}
    harness.write_results("multimodal", results, args.json, loadavg_start=start_load)


def _cells(row: dict[str, Any]) -> dict[str, str]:
    return {
        "mode": row["mode"],
        "req/s": f"{row['req_per_s']:.2f}",
        "TTFT p50 ms": f"{row['ttft_p50_ms']:.0f}",
        "TTFT p90 ms": f"{row['ttft_p90_ms']:.0f}",
        "p50 repeated": f"{row['repeat_ttft_p50_ms']:.0f}",
        "p50 new": f"{row['fresh_ttft_p50_ms']:.0f}",
        "hit rate": f"{row['hit_rate']:.1%}",
        "repeat hit": f"{row['repeat_hit_rate']:.1%}",
        "encoded": f"{row['images_encoded']:.0f}",
        "emb. cache hits": f"{row['image_cache_hits']:.0f}",
        "failed": str(row["failed"]),
    }


def _line(row: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in _cells(row).items() if k != "mode")


if __name__ == "__main__":
    main()
