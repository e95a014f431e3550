"""`POST /v1/embeddings`: tokenize the inputs, send them to one of the model's workers over the request
plane (endpoint `embed`), and return OpenAI's list of vectors (floats, or base64 of little-endian float32).

NOTE: only a model whose card lists Feature.EMBEDDINGS is served (llamacpp with `embeddings=true`);
any other is a 400 naming the model and its engine. The worker is held as a generation's is (core/holds.py):
the one with the fewest requests in flight among the live, not busy ones, since embeddings leave no KV behind
to route to; with every one busy the request waits in the model's queue; a worker that fails or sends nothing
for the stall timeout (it is hung) is left for another, up to the migration limit.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from msgspec import Meta

from dynamo_cli.core.dispatch import DispatchRules
from dynamo_cli.core.holds import Hold, Pool, Wanted, choose_or_wait
from dynamo_cli.core.queue import QueuedRequest
from dynamo_cli.engine import Feature, check_token_ids
from dynamo_cli.errors import RemoteError, RequestError, TransportError
from dynamo_cli.frontend.openai import INT32_MAX, decode_body
from dynamo_cli.frontend.served_models import ServedModel
from dynamo_cli.wire import EMBED, EmbedRequest

MAX_INPUTS = 2048
EMBED_TIMEOUT_S = 120.0
"""Longest wait for a worker's embeddings."""


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's embeddings request, as far as this server honours it."""

    model: str
    input: str | Annotated[list[Any], Meta(min_length=1, max_length=MAX_INPUTS)]
    """A text, texts, one input's token ids, or several inputs' token ids (checked in `parse_embeddings`:
    msgspec takes one list type per union)."""
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    """Metadata: accepted, asks nothing of the model."""


_decoder = msgspec.json.Decoder(EmbeddingRequest)


def parse_embeddings(body: bytes) -> EmbeddingRequest:
    request: EmbeddingRequest = decode_body(_decoder, body)
    raw = request.input
    inputs = [raw] if isinstance(raw, str) or all(type(x) is int for x in raw) else raw
    for item in inputs:
        is_text = isinstance(item, str)
        is_ids = isinstance(item, list) and all(type(x) is int and 0 <= x <= INT32_MAX for x in item)
        if not (is_text or is_ids) or not item:
            raise RequestError(
                "input must be a non-empty string, a list of them, a list of token ids (0.."
                f"{INT32_MAX}) or a list of such lists",
                param="input",
            )
    return request


async def embed(entry: ServedModel, request: EmbeddingRequest, rules: DispatchRules) -> bytes:
    """The response body for `request` on `entry`'s model, its worker held under the process's `rules`."""
    card = entry.card
    if Feature.EMBEDDINGS.value not in card.features:
        raise RequestError(
            f"model '{entry.name}' ({card.engine} engine) serves no embeddings; serve an engine "
            "with embeddings (llamacpp: --engine-arg embeddings=true)",
            param="model",
            code="unsupported_parameter",
        )
    tokenizer = await entry.tokenizer
    raw = request.input
    items = [raw] if isinstance(raw, str) or isinstance(raw[0], int) else raw
    inputs = [await tokenizer.encode_async(item) if isinstance(item, str) else list(item) for item in items]
    for ids in inputs:
        check_token_ids(ids, "input", tokenizer.vocab_size)
    vectors = await _on_worker(entry, EmbedRequest(request_id="embd-" + uuid.uuid4().hex, inputs=inputs), rules)
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(v, request.encoding_format)}
        for i, v in enumerate(vectors)
    ]
    tokens = sum(len(ids) for ids in inputs)
    return msgspec.json.encode(
        {
            "object": "list",
            "data": data,
            "model": entry.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


async def _on_worker(entry: ServedModel, request: EmbedRequest, rules: DispatchRules) -> list[list[float]]:
    pool = Pool(entry.name, entry.workers, queue=entry.queue)
    wanted, failed = Wanted(request.request_id), set[int]()
    async with asyncio.timeout(EMBED_TIMEOUT_S):
        while True:
            hold = await choose_or_wait(pool, wanted, rules.busy, failed, QueuedRequest(), rules.queue)
            try:
                return await _embed_on(hold, request, rules, entry.name)
            except RemoteError as exc:
                if exc.is_client_error:
                    raise exc.as_request_error() from None
                raise
            except TransportError as exc:
                if not exc.is_migratable or len(failed) >= rules.migration_limit:
                    raise
                failed.add(hold.worker.instance_id)
            finally:
                hold.release()


async def _embed_on(hold: Hold, request: EmbedRequest, rules: DispatchRules, model: str) -> list[list[float]]:
    worker, stream = hold.worker, None
    try:
        stream = await rules.deadline.open(worker, model, EMBED, request)
        batch = await rules.deadline.next_batch(stream, worker, model)
        if not batch:
            raise RemoteError(f"worker {worker.instance_id:x} returned no embeddings")
        return EMBED.decode_reply(batch[0]).embeddings
    finally:
        if stream is not None:
            stream.cancel()


def _encoded(vector: list[float], encoding_format: str) -> Any:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector
