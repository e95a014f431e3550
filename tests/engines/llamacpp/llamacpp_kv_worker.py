"""A separate process for the KV transfer test: one request through a llamacpp engine of a given role.

Reads `{"role", "token_ids", "max_tokens", "kv_transfer"}` as JSON on stdin; writes
`{"token_ids", "finish_reason", "kv_transfer"}` as JSON on stdout.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root, installed or not

from dynamo_cli.engine import EngineArgs, GenerateRequest, Role  # noqa: E402
from engines.llamacpp.engine import LlamaCppEngine  # noqa: E402


async def main() -> None:
    job = json.load(sys.stdin)
    engine = LlamaCppEngine(EngineArgs(model="smollm2", role=Role(job["role"]), extra={"n_ctx": 2048}))
    await engine.start()
    request = GenerateRequest(
        request_id="transfer",
        token_ids=job["token_ids"],
        max_tokens=job["max_tokens"],
        temperature=0.0,
        ignore_eos=True,
        kv_transfer=job.get("kv_transfer"),
    )
    tokens, last = [], None
    async for chunk in engine.generate(request):
        tokens += chunk.token_ids
        last = chunk
    await engine.stop()
    assert last is not None
    json.dump(
        {"token_ids": tokens, "finish_reason": last.finish_reason, "kv_transfer": last.kv_transfer},
        sys.stdout,
    )


if __name__ == "__main__":
    asyncio.run(main())
