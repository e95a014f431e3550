"""A load client that is neither dyn's nor Dynamo's: aiohttp, streaming chat completions, one timestamp per chunk.

It drives any OpenAI-compatible server the same way, so a side-by-side measures the servers and not their own load
generators (`dyn bench` is dyn's; aiperf is Dynamo's). Two modes:

- open loop (`replay`): each request leaves at its time in a trace, whether or not earlier ones have answered, as a
  production front door sees them. Bursts of simultaneous arrivals stay bursts.
- closed loop (`closed`): `concurrency` clients, each sending its next request when the last one ends.

Prompts are made of single-token words of the served model's tokenizer (a space and letters, which a byte-level BPE
never merges across), so a prompt of n words is n tokens, and a trace's hash id always becomes the same block of
words: requests that share hash ids share exactly that token prefix, as the trace says they do.

TTFT is the time to the first chunk with content; ITL the gaps between content chunks after it; e2e the time to the
last byte. Per request it records what the server sent (`usage` when the server reports it), so both sides are seen
to have done the same work.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

TIMEOUT_S = 300.0
"""No request waits longer than this (a server that hangs is recorded as an error, not waited for)."""


@dataclass(frozen=True, slots=True)
class Job:
    """One request to send: when (seconds after the start; 0 in closed loop), its prompt and its output length."""

    at: float
    prompt: str
    input_tokens: int
    max_tokens: int
    reachable_tokens: int = 0
    """Its prompt tokens in blocks an earlier request of the trace already sent: the best hit any router can have."""


@dataclass(slots=True)
class Record:
    """What one request saw, in seconds from the run's start (chunk times are from the request's own start)."""

    sent: float
    input_tokens: int
    max_tokens: int
    reachable_tokens: int = 0
    status: int = 0
    error: str = ""
    ttft: float = math.nan
    e2e: float = math.nan
    chunks: list[float] = field(default_factory=list)
    """Arrival of each content chunk, seconds after sending."""
    output_tokens: int = 0
    cached_tokens: int = 0
    """`usage.prompt_tokens_details.cached_tokens` when the server reports it."""


# ---------------------------------------------------------------------------------------------------- prompts


class Words:
    """The served model's single-token words, and blocks of them keyed by a trace's hash id."""

    def __init__(self, tokenizer_json: Path, seed: int = 0) -> None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tokenizer_json))
        words = []
        for text, token_id in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
            if text.startswith("Ġ") and text[1:].isalpha() and text[1:].islower() and 3 <= len(text) <= 9:
                word = " " + text[1:]
                if tok.encode(word, add_special_tokens=False).ids == [token_id]:
                    words.append(word)
        if len(words) < 500:
            raise SystemExit(f"{tokenizer_json}: only {len(words)} single-token words")
        self.words = words
        self._seed = seed

    def block(self, key: int, n: int) -> str:
        """`n` words, always the same for the same `key`."""
        rng = random.Random(key * 1_000_003 + self._seed)
        return "".join(rng.choice(self.words) for _ in range(n))


def trace_jobs(
    path: Path,
    words: Words,
    *,
    start_s: float,
    seconds: float,
    speed: float,
    length_scale: int,
    max_input: int,
    max_output: int,
    salt: int = 0,
) -> list[Job]:
    """The requests of a Mooncake trace (timestamp in ms, input/output length, 512-token hash ids) in the window
    [start_s, start_s + seconds) of *replayed* time: the trace's time divided by `speed`, its lengths (and block
    size) divided by `length_scale`; inputs clipped to `max_input` tokens, outputs to `max_output`. A new `salt`
    gives every hash id new words: the same trace with nothing in common with the last replay (so each round starts
    with cold caches)."""
    block = 512 // length_scale
    seen: set[int] = set()
    jobs: list[Job] = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        at = row["timestamp"] / 1e3 / speed - start_s
        hashes = row["hash_ids"]
        if at >= seconds:
            break
        if at < 0:
            seen.update(hashes)  # requests before the window still warm the caches' history
            continue
        n_in = min(max(1, row["input_length"] // length_scale), max_input)
        n_blocks = min(len(hashes), math.ceil(n_in / block))
        sizes = [min(block, n_in - i * block) for i in range(n_blocks)]
        parts = [words.block(h + salt * 10**9, n) for h, n in zip(hashes, sizes, strict=False)]
        cached = 0
        for h in hashes[:n_blocks]:
            if h not in seen:
                break
            cached += 1
        seen.update(hashes)
        n_out = min(max(2, row["output_length"] // length_scale), max_output)
        jobs.append(Job(at, "".join(parts), n_in, n_out, min(cached * block, n_in)))
    return jobs


def unique_jobs(words: Words, count: int, isl: int, osl: int, seed: int) -> list[Job]:
    """`count` prompts of `isl` tokens that share nothing (closed loop)."""
    base = 10_000_000 * (seed + 1)
    return [Job(0.0, words.block(base + i, isl), isl, osl) for i in range(count)]


# ------------------------------------------------------------------------------------------------- the client


def body(model: str, job: Job) -> dict[str, Any]:
    """A chat request: one user message (the model's chat template adds its default system prompt)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": job.prompt}],
        "max_tokens": job.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


async def send(session: aiohttp.ClientSession, url: str, model: str, job: Job, t0: float) -> Record:
    """One streaming request; every failure is a recorded error, never an exception."""
    rec = Record(time.perf_counter() - t0, job.input_tokens, job.max_tokens, job.reachable_tokens)
    start = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body(model, job)) as resp:
            rec.status = resp.status
            if resp.status != 200:
                rec.error = (await resp.text())[:300]
                return rec
            buf = b""
            async for data in resp.content.iter_any():
                now = time.perf_counter() - start
                buf += data
                *events, buf = buf.split(b"\n\n")
                for event in events:
                    _read_event(event, now, rec)
            rec.e2e = time.perf_counter() - start
    except (aiohttp.ClientError, TimeoutError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    if rec.chunks:
        rec.ttft = rec.chunks[0]
    return rec


def _read_event(event: bytes, now: float, rec: Record) -> None:
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]" or not payload:
            continue
        doc = json.loads(payload)
        for choice in doc.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                rec.chunks.append(now)
        usage = doc.get("usage")
        if usage:
            rec.output_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            rec.cached_tokens = int(details.get("cached_tokens") or 0)


def _session(limit: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=limit, force_close=False)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=TIMEOUT_S))


async def replay(url: str, model: str, jobs: Sequence[Job]) -> list[Record]:
    """Open loop: each job leaves at its `at`, however many are still running."""
    async with _session(limit=0) as session:
        t0 = time.perf_counter()

        async def timed(job: Job) -> Record:
            delay = job.at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            return await send(session, url, model, job, t0)

        return list(await asyncio.gather(*(timed(job) for job in jobs)))


async def closed(
    url: str, model: str, jobs: Sequence[Job], concurrency: int, warmup: int, seconds: float = math.inf
) -> list[Record]:
    """Closed loop: `concurrency` clients take the jobs in order until they run out or `seconds` pass; the first
    `warmup` records are dropped."""
    queue = list(reversed(jobs))
    records: list[Record] = []
    async with _session(limit=concurrency) as session:
        t0 = time.perf_counter()
        deadline = t0 + seconds

        async def client() -> None:
            while queue and time.perf_counter() < deadline:
                records.append(await send(session, url, model, queue.pop(), t0))

        await asyncio.gather(*(client() for _ in range(concurrency)))
    records.sort(key=lambda r: r.sent)
    return records[warmup:]


# ---------------------------------------------------------------------------------------------------- figures


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (linear interpolation), nan for no values."""
    xs = sorted(v for v in values if not math.isnan(v))
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(records: Sequence[Record], wall_s: float) -> dict[str, float]:
    """TTFT p50/p90/p99, ITL p50/p99, e2e p50/p90 (ms), req/s and output tok/s, hit rate (and the best any router
    could reach), errors. Apart: each request's first gap (p50; a disaggregated stream's hand-over from its prefill
    worker's token to its decode worker's first) and the ITL p99 of the gaps after it."""
    ok = [r for r in records if not r.error and r.chunks]
    itl = [b - a for r in ok for a, b in zip(r.chunks, r.chunks[1:], strict=False)]
    first_gaps = [(r.chunks[1] - r.chunks[0]) * 1e3 for r in ok if len(r.chunks) > 1]
    later = [b - a for r in ok for a, b in zip(r.chunks[1:], r.chunks[2:], strict=False)]
    ttft = [r.ttft * 1e3 for r in ok]
    e2e = [r.e2e * 1e3 for r in ok]
    prompt = sum(r.input_tokens for r in ok)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "ttft_p50": pct(ttft, 50),
        "ttft_p90": pct(ttft, 90),
        "ttft_p99": pct(ttft, 99),
        "itl_p50": pct([x * 1e3 for x in itl], 50),
        "itl_p99": pct([x * 1e3 for x in itl], 99),
        "gap1_p50": pct(first_gaps, 50),
        "itl_later_p99": pct([x * 1e3 for x in later], 99),
        "e2e_p50": pct(e2e, 50),
        "e2e_p90": pct(e2e, 90),
        "req_s": len(ok) / wall_s if wall_s > 0 else math.nan,
        "output_tok_s": sum(len(r.chunks) for r in ok) / wall_s if wall_s > 0 else math.nan,
        "hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else math.nan,
        "reachable_hit_rate": sum(r.reachable_tokens for r in ok) / prompt if prompt else math.nan,
    }


def rows(records: Sequence[Record]) -> list[dict[str, Any]]:
    """The records as plain dicts (for the JSON), chunk times kept."""
    return [asdict(r) for r in records]
