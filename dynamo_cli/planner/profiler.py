"""The profiler: sweep one engine through the contract and write its Profile.

A profile describes one engine; of an engine serving several data-parallel ranks (its info's `dp_size`), one rank,
its first: every request is pinned to it (`GenerateRequest.dp_rank`) and its KV cache and `max_num_seqs` are the
engine's over `dp_size` (a ranked engine reports its ranks' sums). Pinned, the decode sweep's `n` requests share
exactly that rank's cache; spread over the ranks and the totals divided by R, the measured ITL would be an average
over ranks at whatever uneven loads the engine's own placement (or `n` not a multiple of R) left them.

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
from dataclasses import dataclass, replace

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


@dataclass(frozen=True, slots=True)
class ProfiledRank:
    """The engine a profile describes: a rank-blind engine, or a ranked engine's first rank (module docstring)."""

    engine: Engine
    """The started engine."""
    info: EngineInfo
    """What the profiled rank holds: its KV blocks and `max_num_seqs`."""
    dp_rank: int | None = None
    """The rank every request is pinned to (None: a rank-blind engine)."""

    @classmethod
    def of(cls, engine: Engine, info: EngineInfo) -> ProfiledRank:
        """The first rank of `engine` (started, `info` its answer), or the whole engine if rank-blind."""
        num_ranks, first = int(info.extra.get("dp_size", 1)), int(info.extra.get("dp_start", 0))
        if num_ranks == 1 and first == 0:
            return cls(engine, info)
        one = replace(
            info, total_kv_blocks=info.total_kv_blocks // num_ranks, max_num_seqs=max(info.max_num_seqs // num_ranks, 1)
        )
        return cls(engine, one, first)

    def request(self, request_id: str, token_ids: list[int], max_tokens: int) -> GenerateRequest:
        """A sweep request of `max_tokens` tokens on this rank, never stopped early."""
        sampling = SamplingParams(ignore_eos=True)
        return GenerateRequest(
            request_id=request_id, token_ids=token_ids, max_tokens=max_tokens, sampling=sampling, dp_rank=self.dp_rank
        )


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


async def measure_ttft_ms(rank: ProfiledRank, rng: random.Random, isl: int, sweep: Sweep) -> float:
    best = float("inf")
    for i in range(sweep.repeats):
        request = rank.request(f"profile-prefill-{isl}-{i}", _prompt(rng, rank.info, isl), 1)
        started = time.perf_counter()
        async with asyncio.timeout(sweep.timeout_s):
            stamps = await _run(rank.engine, request)
        best = min(best, (stamps[0][0] if stamps else time.perf_counter()) - started)
    return best * 1000


def admission_passes(info: EngineInfo, context: int, n: int) -> int:
    """Passes the engine needs to prefill `n` prompts of `context` tokens (its token budget per pass)."""
    return -(-n * context // max(info.max_num_batched_tokens, 1)) + 1


async def measure_itl_ms(rank: ProfiledRank, rng: random.Random, context: int, n: int, sweep: Sweep) -> float:
    """Mean token gap once all `n` requests decode (the admission, whose passes interleave prefill, is left
    out; requests run long enough to outlast it). A mean over the window, not a median of gaps: an engine
    that catches up on a late pass (the mocker keeps its schedule) has short and long gaps that average out."""
    max_tokens = sweep.decode_tokens + admission_passes(rank.info, context, n)
    requests = [
        rank.request(f"profile-decode-{context}-{n}-{i}", _prompt(rng, rank.info, context), max_tokens)
        for i in range(n)
    ]
    async with asyncio.timeout(sweep.timeout_s):
        runs = await asyncio.gather(*(_run(rank.engine, r) for r in requests))
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
    """Sweep a started engine (of a ranked one, its first rank); times in model time (measured × speedup_ratio)."""
    rank, rng = ProfiledRank.of(engine, info), random.Random(0)
    isls = [isl for isl in sweep.isls if isl + 1 <= info.context_length]
    points = decode_points(rank.info, sweep)
    total, prefill, decode = len(isls) + len(points), list[PrefillSample](), list[DecodeSample]()
    max_kv = rank.info.total_kv_blocks * rank.info.block_size
    for isl in isls:
        ttft = await measure_ttft_ms(rank, rng, isl, sweep) * speedup_ratio
        prefill.append(PrefillSample(isl=isl, ttft_ms=round(ttft, 3)))
        if progress is not None:
            progress(f"prefill ISL {isl}: TTFT {ttft:.1f} ms", len(prefill), total)
    for context, n in points:
        itl = await measure_itl_ms(rank, rng, context, n, sweep) * speedup_ratio
        resident = context + admission_passes(rank.info, context, n) + sweep.decode_tokens / 2
        usage = n * resident / max_kv
        decode.append(
            DecodeSample(kv_usage=round(usage, 4), context_length=context, itl_ms=round(itl, 3), concurrency=n)
        )
        if progress is not None:
            progress(f"decode context {context} × {n}: ITL {itl:.1f} ms", len(prefill) + len(decode), total)
    return Profile(
        engine=engine_name,
        model=model,
        max_kv_tokens=max_kv,
        max_num_seqs=rank.info.max_num_seqs,
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
