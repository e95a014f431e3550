"""`GET /openapi.json`: the OpenAPI 3.1 document of every route, its request schemas generated from the
same msgspec types that validate the requests, so the document cannot drift from what is accepted."""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import msgspec

from dynamo_cli.frontend.embeddings import EmbeddingRequest
from dynamo_cli.frontend.loras import LoadLora, UnloadLora
from dynamo_cli.frontend.messages import MessagesRequest
from dynamo_cli.frontend.openai import ChatCompletionRequest, CompletionRequest
from dynamo_cli.frontend.responses_api import ResponsesRequest
from dynamo_cli.frontend.scoring import RerankRequest, ScoreTextsRequest
from dynamo_cli.frontend.tokenize import DetokenizeRequest, TokenizeRequest

_REF = "#/components/schemas/{name}"

POST_ROUTES: dict[str, tuple[str, type[msgspec.Struct]]] = {
    "/v1/chat/completions": ("Chat completion (stream: SSE of chat.completion.chunk)", ChatCompletionRequest),
    "/v1/completions": ("Text completion (stream: SSE of text_completion)", CompletionRequest),
    "/v1/responses": ("Responses, stateless, translated onto chat (stream: typed SSE events)", ResponsesRequest),
    "/v1/embeddings": ("Embeddings (models whose engine serves them)", EmbeddingRequest),
    "/v1/rerank": ("Rerank documents against a query (Cohere/Jina shape; also /v2/rerank, /rerank)", RerankRequest),
    "/v1/score": ("Score text pairs, one to many or pairwise (vLLM's shape; also /score)", ScoreTextsRequest),
    "/tokenize": ("A prompt's or a chat's token ids, as a worker is sent them (vLLM's shape)", TokenizeRequest),
    "/detokenize": ("The text of token ids (vLLM's shape)", DetokenizeRequest),
    "/v1/messages": ("Anthropic Messages, text only, translated onto chat (stream: its events)", MessagesRequest),
    "/v1/load_lora_adapter": ("Load a LoRA adapter on the base model's workers (vLLM's body)", LoadLora),
    "/v1/unload_lora_adapter": ("Unload a LoRA adapter from every worker (vLLM's body)", UnloadLora),
}
"""Path -> (summary, the msgspec type its body is decoded into)."""
STREAMING = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})
"""The POST routes that answer `stream: true` with server-sent events; the others answer JSON only."""

GET_ROUTES: dict[str, str] = {
    "/v1/models": "The models served now (one entry per model with live workers; LoRA adapters with their parent)",
    "/v1/loras": "The LoRA adapters served, with the workers serving each and those that have it loaded",
    "/health": "200 with the serving instances, 503 when there are none",
    "/live": "200 while the process runs",
    "/metrics": "Prometheus metrics",
    "/openapi.json": "This document",
}

BATCH_ROUTES: dict[tuple[str, str], str] = {
    ("post", "/v1/files"): "Upload a batch input file (multipart: purpose=batch, file)",
    ("get", "/v1/files"): "The uploaded and produced files, newest first (purpose, after, limit)",
    ("get", "/v1/files/{file_id}"): "One file",
    ("delete", "/v1/files/{file_id}"): "Delete a file",
    ("get", "/v1/files/{file_id}/content"): "A file's bytes (a batch's output and error files are JSONL)",
    ("post", "/v1/batches"): "Create a batch (input_file_id, endpoint, completion_window 24h, metadata)",
    ("get", "/v1/batches"): "The batches, newest first (after, limit)",
    ("get", "/v1/batches/{batch_id}"): "One batch: status, request_counts, output and error files",
    ("post", "/v1/batches/{batch_id}/cancel"): "Cancel a batch (lines finished stay in its output)",
}
"""OpenAI's Files and Batch API (dynamo_cli/batch/), served unless `--batch-db off`."""

_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}


def openapi_document(post_routes: dict[str, tuple[str, type[msgspec.Struct]]] | None = None) -> dict[str, Any]:
    """The document for `post_routes` (default: this server's) and the GET routes."""
    routes = POST_ROUTES if post_routes is None else post_routes
    types = [kind for _, kind in routes.values()]
    refs, components = msgspec.json.schema_components(types, ref_template=_REF)
    components["Error"] = _ERROR
    paths: dict[str, Any] = {}
    for (path, (summary, _)), ref in zip(routes.items(), refs, strict=True):
        paths[path] = {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
                "responses": {
                    "200": _result(path in STREAMING),
                    "400": _error_response("A field is invalid, unknown, or not honoured by the serving engine"),
                    "404": _error_response("No such model"),
                    "503": _error_response("No worker can take the request now (Retry-After)"),
                },
            }
        }
    for path, summary in GET_ROUTES.items():
        paths[path] = {"get": {"summary": summary, "responses": {"200": {"description": "OK"}}}}
    for (method, path), summary in BATCH_ROUTES.items():
        responses = {"200": {"description": "OK"}, "400": _error_response("A field is invalid (named in param)")}
        paths.setdefault(path, {})[method] = {"summary": summary, "responses": responses}
    return {
        "openapi": "3.1.0",
        "info": {"title": "dyn: OpenAI-compatible API", "version": package_version()},
        "paths": paths,
        "components": {"schemas": components},
    }


def _result(streams: bool) -> dict[str, Any]:
    if not streams:
        return {"description": "The result", "content": {"application/json": {"schema": {"type": "object"}}}}
    return {
        "description": "The result (JSON), or with stream: true an SSE stream ending in [DONE]",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }


def _error_response(description: str) -> dict[str, Any]:
    schema = {"$ref": _REF.format(name="Error")}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


@functools.cache  # read from the installed metadata once
def package_version() -> str:
    """This package's installed version (`0` in a checkout never installed)."""
    try:
        return version("dynamo-cli")
    except PackageNotFoundError:  # a source checkout that was never installed
        return "0"
