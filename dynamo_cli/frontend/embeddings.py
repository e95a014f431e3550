"""`POST /v1/embeddings`: tokenize the inputs, send them to one of the model's workers over the request
plane (endpoint `embed`), and return OpenAI's list of vectors (floats, or base64 of little-endian float32).

NOTE: only a model whose card lists Feature.EMBEDDINGS is served (llamacpp with `embeddings=true`);
any other is a 400 naming the model and its engine. The worker is held as worker_calls.py holds one.
"""

from __future__ import annotations

import base64
import uuid
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from msgspec import Meta

from dynamo_cli.core.dispatch import DispatchRules
from dynamo_cli.core.side_calls import call_worker
from dynamo_cli.engine import Feature, check_token_ids
from dynamo_cli.errors import RequestError
from dynamo_cli.frontend.features import require_feature
from dynamo_cli.frontend.openai import INT32_MAX, decode_body
from dynamo_cli.frontend.served_models import ServedModel
from dynamo_cli.wire import EMBED, EmbedRequest

MAX_INPUTS = 2048


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
    fix = "serve an engine with embeddings (llamacpp: --engine-arg embeddings=true)"
    require_feature(entry, Feature.EMBEDDINGS, "serves no embeddings", fix)
    tokenizer = await entry.tokenizer
    raw = request.input
    items = [raw] if isinstance(raw, str) or isinstance(raw[0], int) else raw
    inputs = [await tokenizer.encode_async(item) if isinstance(item, str) else list(item) for item in items]
    for ids in inputs:
        check_token_ids(ids, "input", tokenizer.vocab_size)
    request_id = "embd-" + uuid.uuid4().hex
    reply = await call_worker(entry, EMBED, EmbedRequest(request_id=request_id, inputs=inputs), request_id, rules)
    vectors = reply.embeddings
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


def _encoded(vector: list[float], encoding_format: str) -> Any:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector
