"""Disaggregation's KV handles: what a prefill worker returns so a decode worker can take over a prompt.

A handle is a tagged union, one struct per engine kind (`kind` on the wire), never a free dict. Every
kind says how many prompt tokens its KV covers (`num_tokens`) and which token the prefill sampled first
(`first_token`): the frontend streams that token at once, and the decode request is the prompt plus
that token, so the decode worker computes none of the prompt and starts by decoding `first_token`.

Where the bytes live depends on the kind:
- llamacpp and the mocker export their KV to the worker as `payload` (engine ↔ worker only, never on
  the request plane); the prefill worker keeps it and sends `blob`, a reference a decode worker pulls
  over the KV transfer plane (`dynamo_cli.runtime.kv_transfer`: TCP or NIXL), once.
- vLLM, SGLang and TRT-LLM move KV with their own libraries (NIXL side channel, bootstrap rendezvous,
  opaque state); their handles carry what that library needs and nothing of ours.
"""

from __future__ import annotations

from typing import Any

import msgspec

MAX_PARAMS_BYTES = 64 * 1024
UNKNOWN_FIRST_TOKEN = -1
"""`first_token` of a handle made before its prefill ran (SGLang's rendezvous): the decode side emits it."""
"""Largest library-defined handle (vLLM params, TRT-LLM opaque state) a worker accepts."""


class BlobRef(msgspec.Struct, frozen=True, kw_only=True):
    """Where a prefill worker holds one KV payload for one decode worker to pull (and so free)."""

    address: str
    """host:port of the prefill worker's KV transfer server."""
    transfer_id: str
    """128 random bits (hex): names the payload and is the capability to read it."""
    nbytes: int
    """Size of the payload; the puller allocates exactly this much."""
    nixl: bytes | None = None
    """NIXL agent metadata and descriptors when the payload is registered with NIXL; None: TCP only."""


class TransferReport(msgspec.Struct, frozen=True, kw_only=True):
    """How one pull went, sent by the decode worker on its first chunk (the frontend's /metrics)."""

    nbytes: int
    seconds: float
    backend: str
    """"tcp" or "nixl"; "local" when the pull failed and the decode worker prefilled itself."""


class _Handle(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    num_tokens: int
    """Prompt tokens whose KV the handle covers (the decode request's first `num_tokens` ids)."""
    first_token: int
    """The token the prefill worker sampled after the prompt."""


class LlamaCppKv(_Handle, tag="llamacpp", frozen=True):
    """llama.cpp's sequence state (`llama_state_seq_get_data`) of the prompt."""

    payload: bytes = b""
    """The state itself, between engine and worker only: empty on the request plane."""
    blob: BlobRef | None = None
    """Where to pull `payload` from, on the request plane."""


class MockerKv(_Handle, tag="mocker", frozen=True):
    """The mocker moves no real KV: `nbytes` is what a transfer would move, timed as nbytes ÷ bandwidth."""

    nbytes: int
    payload: bytes = b""
    blob: BlobRef | None = None
    """An empty payload is still pulled, so the prefill side holds the request until a decode takes it."""


class VllmKv(_Handle, tag="vllm", frozen=True):
    """vLLM's `kv_transfer_params` from its KV connector (NixlConnector: engine id, block ids, host, port)."""

    params: dict[str, Any]


class SglangKv(_Handle, tag="sglang", frozen=True):
    """SGLang's bootstrap rendezvous: the decode engine meets the prefill engine at host:port, room.

    Unlike the other kinds it is made BEFORE the prefill, by the frontend: the chosen prefill engine's
    bootstrap host and port (its `EngineInfo.extra["bootstrap"]`), a random room in 0..2**63-1,
    `num_tokens` = len(prompt) and `first_token` -1 ("unknown: the decode side emits it"). The frontend
    sends the bare prompt (no first token appended) with this handle to the prefill and the decode engine
    CONCURRENTLY; the prefill stream carries no tokens and ends with the handle, the decode stream carries
    every output token, the first included (engines/sglang/engine.py)."""

    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: int


class TrtllmKv(_Handle, tag="trtllm", frozen=True):
    """TRT-LLM's `disaggregated_params.opaque_state`."""

    opaque_state: bytes


KvHandle = LlamaCppKv | MockerKv | VllmKv | SglangKv | TrtllmKv
PULLED_KINDS = (LlamaCppKv, MockerKv)
"""Handles whose payload travels over dyn's own KV transfer plane."""


def check_handle(handle: KvHandle, num_request_tokens: int) -> str | None:
    """What is wrong with a handle arriving at a decode worker (None: nothing): `num_tokens` must leave
    the first token inside the request, library params must stay small, a pulled kind must have a blob."""
    is_rendezvous = isinstance(handle, SglangKv) and handle.first_token == UNKNOWN_FIRST_TOKEN
    last = num_request_tokens if is_rendezvous else num_request_tokens - 1  # the bare prompt, or + first_token
    if not 1 <= handle.num_tokens <= last:
        return f"kv_transfer covers {handle.num_tokens} tokens of a {num_request_tokens}-token request"
    if isinstance(handle, PULLED_KINDS):
        if handle.payload:
            return "kv_transfer carries its payload inline; only a blob reference is accepted"
        if handle.blob is None or handle.blob.nbytes < 0:
            return "kv_transfer has no blob to pull"
    elif isinstance(handle, VllmKv) and len(msgspec.msgpack.encode(handle.params)) > MAX_PARAMS_BYTES:
        return "kv_transfer params are too large"
    elif isinstance(handle, TrtllmKv) and len(handle.opaque_state) > MAX_PARAMS_BYTES:
        return "kv_transfer opaque_state is too large"
    return None
