"""An engine's performance profile: prefill time against ISL and decode ITL against KV usage and context.

The file `dyn plan profile` writes and `dyn plan run` reads (JSON, all times in model time, ms):

    {"version": 1, "engine": "mocker", "model": "m", "max_kv_tokens": 262144, "max_num_seqs": 256,
     "num_gpus_per_engine": 1, "speedup_ratio": 10.0,
     "prefill": [{"isl": 512, "ttft_ms": 30.1}, ...],                 # one request alone, batch 1
     "decode": [{"kv_usage": 0.25, "context_length": 2048, "itl_ms": 17.6, "concurrency": 32}, ...]}

`kv_usage` is active KV tokens / `max_kv_tokens` (0..1) while `concurrency` requests of about
`context_length` tokens decode together. `speedup_ratio` is what the profiler ran the engine at; the
times are already multiplied back by it.

NOTE: interpolation is piecewise linear and clamped to the profiled range (Dynamo's classic planner uses
cubic splines, also clamped), so a profile of a few points still gives monotone, explainable answers.
Decode ITL at (usage, context) interpolates along usage within each profiled context, then between the
two nearest contexts.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path

import msgspec

from dynamo_cli.errors import ConfigError

PROFILE_VERSION = 1
USAGE_STEPS = 100
"""`best_decode_throughput` scans KV usage in this many steps (Dynamo's decode grid is 100x100)."""


class PrefillSample(msgspec.Struct, frozen=True, kw_only=True):
    """One unloaded prefill: a prompt of `isl` tokens took `ttft_ms` to its first token."""

    isl: int
    ttft_ms: float


class DecodeSample(msgspec.Struct, frozen=True, kw_only=True):
    """One decode operating point: inter-token latency with a fraction `kv_usage` of the KV cache in use."""

    kv_usage: float
    context_length: int
    itl_ms: float
    concurrency: int = 0


class Profile(msgspec.Struct, frozen=True, kw_only=True):
    """A profiled engine (the documented JSON file)."""

    version: int = PROFILE_VERSION
    engine: str
    model: str
    max_kv_tokens: int
    max_num_seqs: int = 256
    num_gpus_per_engine: int = 1
    speedup_ratio: float = 1.0
    prefill: list[PrefillSample]
    decode: list[DecodeSample]


@dataclass(frozen=True, slots=True)
class DecodePoint:
    """The best decode operating point under an ITL target at a context length."""

    kv_usage: float
    """KV usage fraction of the chosen point."""
    concurrency: float
    """Requests decoding together at that usage (capped by max_num_seqs)."""
    itl_ms: float
    """The profile's ITL there."""
    throughput_per_gpu: float
    """Output tokens/s per GPU there: concurrency / ITL / GPUs per engine."""
    meets_itl: bool
    """False when even the lowest usage misses the target (the point is then the lowest usage)."""


def load_profile(path: str | Path) -> Profile:
    """Read and check a profile file; ConfigError names what is wrong."""
    try:
        profile = msgspec.json.decode(Path(path).read_bytes(), type=Profile)
    except (OSError, msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ConfigError(f"profile '{path}' cannot be read: {exc}; write one with `dyn plan profile`") from exc
    check_profile(profile, str(path))
    return profile


def save_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(profile), indent=1) + b"\n")


def check_profile(profile: Profile, where: str = "profile") -> None:
    if profile.version != PROFILE_VERSION:
        raise ConfigError(f"{where} has version {profile.version}; this dyn reads version {PROFILE_VERSION}")
    if not profile.prefill or not profile.decode or profile.max_kv_tokens <= 0:
        raise ConfigError(f"{where} needs prefill and decode samples and max_kv_tokens > 0; re-run `dyn plan profile`")
    if any(s.isl <= 0 or s.ttft_ms <= 0 for s in profile.prefill) or any(s.itl_ms <= 0 for s in profile.decode):
        raise ConfigError(f"{where} has a non-positive ISL, TTFT or ITL sample")


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear y(x) through sorted `xs`, clamped to the end values outside them."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def prefill_ttft_ms(profile: Profile, isl: float) -> float:
    """Unloaded TTFT of an `isl`-token prompt."""
    points = sorted(profile.prefill, key=lambda s: s.isl)
    return _interp([float(s.isl) for s in points], [s.ttft_ms for s in points], isl)


def prefill_throughput_per_gpu(profile: Profile, isl: float) -> float:
    """Prompt tokens/s one GPU prefills at this ISL: isl / TTFT(isl) / GPUs per engine."""
    return max(isl, 1.0) / (prefill_ttft_ms(profile, isl) / 1000.0) / profile.num_gpus_per_engine


def decode_itl_ms(profile: Profile, kv_usage: float, context_length: float) -> float:
    """ITL at a KV usage and context length: linear in usage per context, then between contexts."""
    by_context: dict[int, list[DecodeSample]] = {}
    for sample in profile.decode:
        by_context.setdefault(sample.context_length, []).append(sample)
    contexts = sorted(by_context)
    itls = []
    for context in contexts:
        points = sorted(by_context[context], key=lambda s: s.kv_usage)
        itls.append(_interp([s.kv_usage for s in points], [s.itl_ms for s in points], kv_usage))
    return _interp([float(c) for c in contexts], itls, context_length)


def kv_usage_of(profile: Profile, concurrency: float, context_length: float) -> float:
    """KV usage when `concurrency` requests of `context_length` tokens are resident (Dynamo's formula)."""
    return concurrency * context_length / profile.max_kv_tokens


def best_decode_throughput(profile: Profile, itl_ms: float, context_length: float) -> DecodePoint:
    """Dynamo's `find_best_throughput_per_gpu`: scan usage from high to low and take the highest whose ITL
    meets `itl_ms`; throughput there is concurrency / ITL, concurrency = usage × max_kv / context."""
    context = max(context_length, 1.0)
    top = min(1.0, profile.max_num_seqs * context / profile.max_kv_tokens)  # past max_num_seqs usage cannot grow
    fallback: DecodePoint | None = None
    for step in range(USAGE_STEPS, 0, -1):
        usage = top * step / USAGE_STEPS
        concurrency = usage * profile.max_kv_tokens / context
        itl = decode_itl_ms(profile, usage, context)
        point = DecodePoint(
            kv_usage=usage,
            concurrency=concurrency,
            itl_ms=itl,
            throughput_per_gpu=concurrency / (itl / 1000.0) / profile.num_gpus_per_engine,
            meets_itl=itl <= itl_ms,
        )
        if point.meets_itl:
            return point
        fallback = point
    assert fallback is not None
    return fallback
