"""The backend's side of the http engine: the request it is sent (an OpenAI completion whose prompt is the token
ids), and its answers read as typed, bounded messages, never trusted further than their types.

NOTE: a backend answers in one of two dialects, found at start (`Dialect`): with each piece's token ids (vLLM's
`return_token_ids`, exact), or with text alone, which the worker tokenizes again with the model's tokenizer (the
text the client sees is the same; the token count can differ at piece boundaries).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

from dynamo_cli.errors import BackendUnavailable, DynError, RequestError
from dynamo_cli.wire import GenerateRequest, TokenLogprob

MAX_LINE_BYTES = 4 * 1024 * 1024
"""The longest line of a backend's event stream taken (a piece, its token ids, its usage)."""

MAX_TAIL_BYTES = 64 * 1024
"""What is read of a stream after its `[DONE]` (a well-behaved backend sends nothing more)."""

MAX_ERROR_BYTES = 64 * 1024
"""How much of a refusal's body is read to find its message."""

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "cancelled", "cancelled": "cancelled"}
"""The backend's finish reasons as the core's; another one (`tool_calls`, an engine's own) ends as "stop"."""


@dataclass(frozen=True, slots=True)
class Dialect:
    token_ids: bool
    """The backend returns each piece's token ids when asked (`return_token_ids`)."""
    logprobs: bool = False
    """It also names the tokens of its logprobs by id when asked (vLLM's `return_tokens_as_token_ids`)."""


class Logprobs(msgspec.Struct):
    """A piece's logprobs in the completions API's shape, its tokens named `token_id:N`."""

    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] | None = None


class Choice(msgspec.Struct):
    text: str = ""
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    logprobs: Logprobs | None = None


TOKEN_ID = "token_id:"


def token_logprobs(logprobs: Logprobs, count: int, top_n: int) -> list[TokenLogprob]:
    """One TokenLogprob per token of a piece of `count` tokens, the `top_n` most likely of each position first;
    BackendUnavailable when the backend's do not add up (another count, a token not named by id)."""
    tops = logprobs.top_logprobs or [None] * len(logprobs.token_logprobs)
    if not (len(logprobs.token_logprobs) == len(tops) == count):
        raise BackendUnavailable(f"logprobs for {len(logprobs.token_logprobs)} tokens in a piece of {count}")
    out = []
    for chosen, top in zip(logprobs.token_logprobs, tops, strict=True):
        ranked = sorted(((_token_id(t), lp) for t, lp in (top or {}).items()), key=lambda p: -p[1])
        out.append(TokenLogprob(logprob=chosen if chosen is not None else float("-inf"), top=ranked[:top_n]))
    return out


def _token_id(token: str) -> int:
    if not token.startswith(TOKEN_ID) or not token[len(TOKEN_ID) :].isdigit():
        raise BackendUnavailable(f"a logprob of token {token[:40]!r}, not named by id")
    return int(token[len(TOKEN_ID) :])


class PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class Usage(msgspec.Struct):
    prompt_tokens_details: PromptDetails | None = None


class Event(msgspec.Struct):
    """One `data:` line of a streamed completion (the fields the worker reads; others are skipped)."""

    choices: list[Choice] = []
    usage: Usage | None = None
    error: dict[str, Any] | None = None

    @property
    def cached_tokens(self) -> int | None:
        details = self.usage.prompt_tokens_details if self.usage is not None else None
        return details.cached_tokens if details is not None else None


class Model(msgspec.Struct):
    id: str
    max_model_len: int | None = None


class Models(msgspec.Struct):
    data: list[Model] = []


_event = msgspec.json.Decoder(Event)
_models = msgspec.json.Decoder(Models)


def completion_body(request: GenerateRequest, model: str, dialect: Dialect) -> dict[str, Any]:
    """The backend's `/v1/completions` body for `request`: its token ids as the prompt, streamed, and only the
    sampling fields that differ from their defaults (a stricter server then refuses none it does not need)."""
    s = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "prompt": request.token_ids,
        "max_tokens": request.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": s.temperature,
    }
    optional: dict[str, Any] = {
        "top_p": (s.top_p, 1.0),
        "top_k": (s.top_k, 0),
        "min_p": (s.min_p, 0.0),
        "seed": (s.seed, None),
        "min_tokens": (s.min_tokens, 0),
        "ignore_eos": (s.ignore_eos, False),
        "stop_token_ids": (s.stop_token_ids, []),
        "presence_penalty": (s.presence_penalty, 0.0),
        "frequency_penalty": (s.frequency_penalty, 0.0),
        "repetition_penalty": (s.repetition_penalty, 1.0),
        "logit_bias": ({str(k): v for k, v in s.logit_bias.items()}, {}),
    }
    body.update({name: value for name, (value, default) in optional.items() if value != default})
    if dialect.token_ids:
        body["return_token_ids"] = True
    if s.logprobs is not None and dialect.logprobs:
        body |= {"logprobs": s.logprobs, "return_tokens_as_token_ids": True}
    return body


async def events(response: httpx.Response) -> AsyncIterator[Event]:
    """The stream's events up to `[DONE]` (or its end); BackendUnavailable for a line that is too long or does
    not decode, or an error event."""
    after = -1  # bytes read after [DONE]: the body's end is read too, so that the connection is kept
    async for line in _lines(response):
        if after >= 0:
            after += len(line)
            if after > MAX_TAIL_BYTES:
                return  # a backend that goes on after [DONE] loses its connection, not this request
            continue
        if not line.startswith(b"data:"):
            continue  # comments, `event:` names, keep-alives
        data = line[5:].strip()
        if data == b"[DONE]":
            after = 0
            continue
        try:
            event = _event.decode(data)
        except msgspec.DecodeError as exc:
            raise BackendUnavailable(f"the backend sent an event that is no completion chunk: {exc}") from None
        if event.error is not None:
            raise BackendUnavailable(f"the backend failed the request: {_message(event.error)}")
        yield event


async def _lines(response: httpx.Response) -> AsyncIterator[bytes]:
    buffer = b""
    async for data in response.aiter_bytes():
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
        if len(buffer) > MAX_LINE_BYTES:
            raise BackendUnavailable(f"the backend sent a line over {MAX_LINE_BYTES} bytes")
    if buffer:
        yield buffer


async def refusal(response: httpx.Response) -> DynError:
    """What a backend's non-200 answer means here: a 4xx other than 429 is the client's (a RequestError with the
    backend's own message and field), anything else the backend's (BackendUnavailable: another one may serve)."""
    body = b""
    async for data in response.aiter_bytes():
        body += data
        if len(body) >= MAX_ERROR_BYTES:
            break
    status = response.status_code
    message, param = _error_of(body[:MAX_ERROR_BYTES])
    if 400 <= status < 500 and status not in (408, 429):
        return RequestError(f"the backend refused the request: {message}", param=param)
    return BackendUnavailable(f"the backend answered {status}: {message}")


def _error_of(body: bytes) -> tuple[str, str | None]:
    try:
        decoded = json.loads(body)
    except (ValueError, RecursionError):
        return body.decode(errors="replace")[:500] or "no message", None
    error = decoded.get("error", decoded) if isinstance(decoded, dict) else decoded
    param = error.get("param") if isinstance(error, dict) else None
    return _message(error), param if isinstance(param, str) else None


def _message(error: Any) -> str:
    if isinstance(error, dict):
        error = error.get("message") or error.get("detail") or error
    return str(error)[:500]


def models_of(body: bytes) -> list[Model]:
    """The models a backend's `/v1/models` lists; BackendUnavailable if it is no model list."""
    try:
        return _models.decode(body).data
    except msgspec.DecodeError as exc:
        raise BackendUnavailable(f"the backend's /v1/models is no model list: {exc}") from None
