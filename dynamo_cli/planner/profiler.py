"""The profiler: sweep one engine through the contract and write its Profile.

Prefill: one request alone per ISL (`max_tokens` 1, random token ids so no prefix-cache hit), TTFT
taken as the fastest of `repeats`. Decode: at each profiled context length, `n` requests decode together
for `usage` of the KV cache (n = usage × max_kv / context, at most max_num_seqs and what fits); ITL is the
mean gap between tokens once every request decodes. Every time is multiplied by the engine's speedup ratio, so a
mocker run at 10× speed gives a profile in modelled time (its step-loop overhead, a few µs per request
per pass, is multiplied too: keep the ratio moderate).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from dynamo_cli.engine import Engine, EngineArgs, EngineInfo, load_engine
from dynamo_cli.planner.profile import DecodeSample, PrefillSample, Profile
from dynamo_cli.wire import GenerateRequest, SamplingParams

Progress = Callable[[str, int, int], None]
"""(what, done, total): called after each sweep point."""


@dataclass(frozen=True, slots=True)
class Sweep:
    """What to measure."""

    isls: tuple[int, ...] = (128, 512, 1024, 2048, 4096, 8192)
    """Prompt lengths of the prefill sweep (those past the context length are skipped)."""
    contexts: tuple[int, ...] = (512, 2048, 8192)
    """Prompt lengths of the decode sweep."""
    usages: tuple[float, ...] = (0.05, 0.25, 0.5, 0.75, 0.9)
    """KV usage fractions of the decode sweep."""
    decode_tokens: int = 24
    """Tokens each decode-sweep request generates."""
    repeats: int = 2
    """Prefill runs per ISL (the fastest counts)."""
    timeout_s: float = 300.0
    """Longest wait for one sweep point."""


def _prompt(rng: random.Random, info: EngineInfo, length: int) -> list[int]:
    high = min(info.vocab_size, 32000) if info.vocab_size else 32000
    return [rng.randrange(1, high) for _ in range(length)]


async def _run(engine: Engine, request: GenerateRequest) -> list[tuple[float, int]]:
    """(time, tokens) of each chunk with tokens."""
    stamps = []
    async for chunk in engine.generate(request):
        if chunk.token_ids:
            stamps.append((time.perf_counter(), len(chunk.token_ids)))
    return stamps


async def measure_ttft_ms(engine: Engine, info: EngineInfo, rng: random.Random, isl: int, sweep: Sweep) -> float:
    best = float("inf")
    for i in range(sweep.repeats):
        request = GenerateRequest(
            request_id=f"profile-prefill-{isl}-{i}",
            token_ids=_prompt(rng, info, isl),
            max_tokens=1,
            sampling=SamplingParams(ignore_eos=True),
        )
        started = time.perf_counter()
        async with asyncio.timeout(sweep.timeout_s):
            stamps = await _run(engine, request)
        best = min(best, (stamps[0][0] if stamps else time.perf_counter()) - started)
    return best * 1000


def admission_passes(info: EngineInfo, context: int, n: int) -> int:
    """Passes the engine needs to prefill `n` prompts of `context` tokens (its token budget per pass)."""
    return -(-n * context // max(info.max_num_batched_tokens, 1)) + 1


async def measure_itl_ms(
    engine: Engine, info: EngineInfo, rng: random.Random, context: int, n: int, sweep: Sweep
) -> float:
    """Mean token gap once all `n` requests decode (the admission, whose passes interleave prefill, is left
    out; requests run long enough to outlast it). A mean over the window, not a median of gaps: an engine
    that catches up on a late pass (the mocker keeps its schedule) has short and long gaps that average out."""
    max_tokens = sweep.decode_tokens + admission_passes(info, context, n)
    requests = [
        GenerateRequest(
            request_id=f"profile-decode-{context}-{n}-{i}",
            token_ids=_prompt(rng, info, context),
            max_tokens=max_tokens,
            sampling=SamplingParams(ignore_eos=True),
        )
        for i in range(n)
    ]
    async with asyncio.timeout(sweep.timeout_s):
        runs = await asyncio.gather(*(_run(engine, r) for r in requests))
    all_started = max((run[0][0] for run in runs if run), default=0.0)
    span = tokens = 0.0
    for run in runs:
        steady = [(t, k) for t, k in run if t >= all_started]
        if len(steady) > 1:
            span += steady[-1][0] - steady[0][0]
            tokens += sum(k for _, k in steady[1:])
    return span / tokens * 1000 if tokens else 0.0


def decode_points(info: EngineInfo, sweep: Sweep) -> list[tuple[int, int]]:
    """(context, concurrency) pairs of the decode sweep: distinct, fitting the KV cache and max_num_seqs."""
    max_kv = info.total_kv_blocks * info.block_size
    points: list[tuple[int, int]] = []
    for context in sweep.contexts:
        if context + sweep.decode_tokens > info.context_length:
            continue
        fits = int(0.95 * max_kv // (context + sweep.decode_tokens))
        for usage in sweep.usages:
            n = max(1, min(round(usage * max_kv / context), info.max_num_seqs, fits))
            if (context, n) not in points:
                points.append((context, n))
    return points


async def profile_engine(
    engine: Engine,
    info: EngineInfo,
    *,
    engine_name: str,
    model: str,
    speedup_ratio: float,
    sweep: Sweep = Sweep(),
    progress: Progress | None = None,
) -> Profile:
    """Sweep a started engine; times in model time (measured × speedup_ratio)."""
    rng = random.Random(0)
    isls = [isl for isl in sweep.isls if isl + 1 <= info.context_length]
    points = decode_points(info, sweep)
    total, done = len(isls) + len(points), 0
    max_kv = info.total_kv_blocks * info.block_size
    prefill = []
    for isl in isls:
        ttft = await measure_ttft_ms(engine, info, rng, isl, sweep) * speedup_ratio
        prefill.append(PrefillSample(isl=isl, ttft_ms=round(ttft, 3)))
        done += 1
        if progress is not None:
            progress(f"prefill ISL {isl}: TTFT {ttft:.1f} ms", done, total)
    decode = []
    for context, n in points:
        itl = await measure_itl_ms(engine, info, rng, context, n, sweep) * speedup_ratio
        resident = context + admission_passes(info, context, n) + sweep.decode_tokens / 2
        usage = n * resident / max_kv
        decode.append(
            DecodeSample(kv_usage=round(usage, 4), context_length=context, itl_ms=round(itl, 3), concurrency=n)
        )
        done += 1
        if progress is not None:
            progress(f"decode context {context} × {n}: ITL {itl:.1f} ms", done, total)
    return Profile(
        engine=engine_name,
        model=model,
        max_kv_tokens=max_kv,
        max_num_seqs=info.max_num_seqs,
        speedup_ratio=speedup_ratio,
        prefill=prefill,
        decode=decode,
    )


QUICK_SWEEP = Sweep(isls=(256, 1024, 4096), contexts=(1024, 4096), usages=(0.05, 0.5, 0.9), repeats=1)
"""`dyn serve --planner` with no profile: enough points for the interpolation, a few seconds on the mocker."""
PROFILE_SPEEDUP = 10.0
"""The mocker is profiled at least this fast; its times are scaled back to the deployment's speed."""


async def profile_mocker_as_deployed(args: EngineArgs) -> Profile:
    """Profile the mocker with the deployment's engine args, in the deployment's wall time (its speedup ratio
    applied, unlike `dyn plan profile`'s model time): run at >= PROFILE_SPEEDUP, times × (that / deployed)."""
    deployed = float(args.extra.get("speedup_ratio", 1.0))
    fast = max(deployed, PROFILE_SPEEDUP)
    engine = load_engine("mocker")(
        EngineArgs(
            model=args.model,
            block_size=args.block_size,
            context_length=args.context_length,
            extra={**args.extra, "speedup_ratio": fast},
        )
    )
    info = await engine.start()
    try:
        return await profile_engine(
            engine, info, engine_name="mocker", model=args.model, speedup_ratio=fast / deployed, sweep=QUICK_SWEEP
        )
    finally:
        await engine.stop()
