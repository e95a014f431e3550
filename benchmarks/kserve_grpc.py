"""The KServe gRPC frontend's cost against HTTP: one `dyn serve --engine mocker --kserve-grpc-port 0` (engine time
~0), the same completion asked over /v1/completions (httpx, one kept-alive connection) and over ModelInfer and
ModelStreamInfer (Triton's `tritonclient.grpc`), one request at a time, the sides alternated in each round, with an
HTTP A/A pair as the noise floor. Prints each side's median and p90 latency (ms) and their ratios to HTTP.

    python benchmarks/kserve_grpc.py [--rounds 5] [--requests 200] [--max-tokens 16] [--json PATH]
"""

from __future__ import annotations

import argparse
import queue
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import loadavg, serving, write_results  # noqa: E402

MODEL = "mock"
PROMPT = "The quick brown fox jumps over the lazy dog " * 8
GRPC = re.compile(r"kserve grpc (\S+?)\)")


def _timed(call: Callable[[], Any], n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _sides(url: str, address: str, max_tokens: int, closers: list[Callable[[], Any]]) -> dict[str, Callable[[], Any]]:
    """One request of each side, as a call; `closers` gets what closes the clients."""
    import tritonclient.grpc as grpcclient

    http = httpx.Client(base_url=url, timeout=30)
    grpc = grpcclient.InferenceServerClient(url=address)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    tensor = grpcclient.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_))
    streaming = grpcclient.InferInput("streaming", [1], "BOOL")
    streaming.set_data_from_numpy(np.array([True]))
    params = {"max_tokens": max_tokens, "ignore_eos": True}
    got: queue.Queue[Any] = queue.Queue()
    grpc.start_stream(callback=lambda result, error: got.put((result, error)))
    closers += [grpc.stop_stream, grpc.close, http.close]

    def streamed() -> None:
        grpc.async_stream_infer(MODEL, [tensor, streaming], parameters=params)
        while True:
            result, error = got.get(timeout=30)
            if error is not None:
                raise RuntimeError(error)
            if result.as_numpy("finish_reason") is not None:
                return

    return {
        "http": lambda: http.post("/v1/completions", json=body).raise_for_status(),
        "grpc_infer": lambda: grpc.infer(MODEL, [tensor], parameters=params),
        "grpc_stream": streamed,
        "http_again": lambda: http.post("/v1/completions", json=body).raise_for_status(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200, help="per side per round")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    start_load = loadavg()
    flags = ["--engine", "mocker", "--served-model-name", MODEL, "--speedup-ratio", "1000", "--kserve-grpc-port", "0"]
    closers: list[Callable[[], Any]] = []
    with serving(flags, Path(tempfile.mkdtemp()) / "serve.log") as deployment:
        address = GRPC.search(deployment.log_tail(1 << 20)).group(1)  # type: ignore[union-attr]
        sides = _sides(deployment.url, address, args.max_tokens, closers)
        for call in sides.values():  # warm up each path
            _timed(call, 20)
        samples: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, call in sides.items():
                samples[name] += _timed(call, args.requests)
        for close in closers:
            close()
    base = statistics.median(samples["http"])
    rows = {}
    print(f"{'side':<12} {'p50 ms':>8} {'p90 ms':>8} {'p50 / http':>11}")
    for name, times in samples.items():
        p50, p90 = statistics.median(times), float(np.percentile(times, 90))
        rows[name] = {"p50_ms": p50, "p90_ms": p90, "p50_ratio": p50 / base, "n": len(times)}
        print(f"{name:<12} {p50:8.2f} {p90:8.2f} {p50 / base:11.2f}")
    write_results("kserve_grpc", {"max_tokens": args.max_tokens, "sides": rows}, args.json, loadavg_start=start_load)


if __name__ == "__main__":
    main()
