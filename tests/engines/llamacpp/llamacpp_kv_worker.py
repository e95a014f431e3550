"""A separate process for the KV transfer test: one request through a llamacpp engine of a given role.

Reads a msgpack `Job` on stdin; writes a msgpack `Outcome` on stdout (the handle's payload is raw bytes,
so JSON will not do). Both sides run in deterministic mode, as the token-for-token comparison needs.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, installed or not

from dyn_engines.llamacpp.engine import LlamaCppEngine  # noqa: E402

from dynamo_cli.engine import EngineArgs, Role
from dynamo_cli.kv.handles import LlamaCppKv  # noqa: E402
from dynamo_cli.wire import GenerateRequest, SamplingParams


class Job(msgspec.Struct, frozen=True, kw_only=True):
    """One request for the worker process."""

    role: str
    token_ids: list[int]
    max_tokens: int
    kv_transfer: LlamaCppKv | None = None


class Outcome(msgspec.Struct, frozen=True, kw_only=True):
    """What the request streamed, and the decode engine's prefill counter after it."""

    token_ids: list[int]
    finish_reason: str | None
    kv_transfer: LlamaCppKv | None
    num_prefill_tokens_computed: int


async def main() -> None:
    job = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=Job)
    extra = {"deterministic": True, "max_num_seqs": 2, "max_cached_seqs": 1, "n_threads": 1}
    engine = LlamaCppEngine(EngineArgs(model="smollm2", role=Role(job.role), context_length=512, extra=extra))
    await engine.start()
    request = GenerateRequest(
        request_id="transfer",
        token_ids=job.token_ids,
        max_tokens=job.max_tokens,
        sampling=SamplingParams(temperature=0.0, ignore_eos=True),
        kv_transfer=job.kv_transfer,
    )
    tokens, last = [], None
    async for chunk in engine.generate(request):
        tokens += chunk.token_ids
        last = chunk
    computed = engine.load_metrics().num_prefill_tokens_computed
    await engine.stop()
    assert last is not None
    handle = last.kv_transfer
    assert handle is None or isinstance(handle, LlamaCppKv)
    outcome = Outcome(
        token_ids=tokens, finish_reason=last.finish_reason, kv_transfer=handle, num_prefill_tokens_computed=computed
    )
    sys.stdout.buffer.write(msgspec.msgpack.encode(outcome))


if __name__ == "__main__":
    asyncio.run(main())
