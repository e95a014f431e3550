"""OpenAI request schemas, validated at the edge with msgspec; errors name the offending field."""

from __future__ import annotations

import array
import re
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from msgspec import Meta

from dynamo_cli.errors import RequestError
from dynamo_cli.frontend.media import ImageRef
from dynamo_cli.frontend.tools.types import MAX_TOOLS, ResponseFormat, Tool, ToolCall, ToolChoice

MAX_STOP_SEQUENCES = 32
MAX_JSON_DEPTH = 32
"""Deepest nesting of arrays/objects a request body may have (OpenAI's own bodies need under 10)."""
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


MAX_URL_CHARS = 30 * 1024 * 1024
"""Longest image URL (a data: URL of the largest image the media settings allow, in base64)."""
IMAGE_MARKER = "<|dyn-image|>"
"""Where an image part was, in the text handed to the chat template (frontend/prompts.py splits on it)."""


class ImageUrl(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    url: Annotated[str, Meta(min_length=1, max_length=MAX_URL_CHARS)]
    """A data: URL (base64), an https: URL, or a file: URL under --mm-local-dir (frontend/media.py)."""
    detail: Literal["auto", "low", "high"] = "auto"
    """low: downsized to 512 px on the long side before the model sees it; auto and high: as sent."""


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None
    image_url: ImageUrl | None = None
    """Type image_url: the image."""


class Message(msgspec.Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    """Role tool: the call this message answers."""
    tool_calls: list[ToolCall] | None = None
    """Role assistant: the calls it made."""


Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
MaxTokens = Annotated[int, Meta(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]
"""A token id as engines take it; the model's vocabulary bounds it further (checked once the model is known)."""
LogitBias = Annotated[dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]], Meta(max_length=1024)]
"""OpenAI's logit_bias: token id (a decimal string, JSON keys being strings) -> bias in -100..100."""
MAX_CHOICES = 128


class AgentHints(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Dynamo's `nvext.agent_hints`, as far as they ask something this server does."""

    priority: Annotated[int, Meta(ge=-1000, le=1000)] | None = None
    """The request's place in the wait queue (as `x-dyn-priority`, which wins when both are sent)."""
    osl: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None
    """Expected output tokens: the wait queue's job size (sjf) counts these instead of max_tokens."""
    resume_after_s: Annotated[float, Meta(gt=0.0, le=3600.0)] | None = None
    """dyn's: the agent runs a tool now and calls again in about this long: the worker keeps this call's KV
    blocks resident that long (within its retain budget) for the session's next call."""


class NvExt(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    agent_hints: AgentHints | None = None


class _Sampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by chat and completions.

    NOTE: nothing accepted is ignored (issue 17). A field unknown here is a 400 naming it; a known field
    is either honoured or, when the serving engine's card lacks its `Feature`, refused with a 400 naming
    the field and the engine (frontend/features.py). The one exception is metadata that asks nothing of
    generation: `user` (OpenAI's end-user id for abuse tracking) and `metadata` are accepted and unused.
    """

    model: str
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=-1, le=INT32_MAX)] | None = None
    min_tokens: Annotated[int, Meta(ge=0, le=INT32_MAX)] = 0
    seed: Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=256)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_CHOICES)] = 1
    """Choices: n requests with the same prompt (seed + i for choice i when seeded)."""
    ignore_eos: bool = False
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] | None = None
    logit_bias: LogitBias | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    user: str | None = None
    """Metadata (the caller's end-user id): accepted, asks nothing of generation."""
    metadata: dict[str, str] | None = None
    """Metadata: accepted, asks nothing of generation."""
    nvext: NvExt | None = None
    """Dynamo's extensions: agent hints (priority, expected output length, the resume of a session)."""


class ChatCompletionRequest(_Sampling, kw_only=True, forbid_unknown_fields=True):
    messages: Annotated[list[Message], Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    """Alternatives per token; needs logprobs: true."""
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    """None: "auto" with tools, "none" without (OpenAI's default)."""
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None


class CompletionRequest(_Sampling, kw_only=True, forbid_unknown_fields=True):
    prompt: str | list[str | int]
    """A string, a list of token ids, or a one-element list of strings (a bool, a float or a list among the
    items is refused at decoding, naming the item)."""
    echo: bool = False
    """Prepend the prompt's text to the completion."""
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    """Each token's logprob and its N most likely alternatives'."""


_PATH = re.compile(r" - at `\$\.?([\w.\[\]]*)")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKETS = bytes(3 if c in b"[{" else 1 if c in b"]}" else 0 for c in range(256))

_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)


def check_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse a body nested deeper than `limit` before any parser recurses into it (C-speed scan:
    strings are cut out, then the running bracket count's maximum is the depth)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return
    skeleton = _STRING.sub(b"", body)
    steps = np.frombuffer(skeleton.translate(_BRACKETS), dtype=np.int8)
    steps = steps[steps != 0] - 2  # "[" / "{" -> +1, "]" / "}" -> -1
    if steps.size and int(np.cumsum(steps, dtype=np.int64).max()) > limit:
        raise RequestError(f"the request body is nested deeper than {limit} levels", code="invalid_json")


def decode_body(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    """`body` decoded by `decoder`, after the depth check; any failure is a RequestError naming the field."""
    check_depth(body)
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise decode_error(exc) from None


def decode_error(exc: Exception) -> RequestError:
    """The 400 for a body msgspec could not decode into its request type, naming the field when it can."""
    if isinstance(exc, UnicodeDecodeError):
        return RequestError(
            f"the request body is not valid UTF-8: {exc.reason} at byte {exc.start}", code="invalid_json"
        )
    if isinstance(exc, RecursionError):
        return RequestError("the request body is nested too deeply", code="invalid_json")
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        return RequestError(f"the request body is not valid JSON: {text}", code="invalid_json")
    unknown, match = _UNKNOWN.search(text), _PATH.search(text)
    if unknown:
        name = f"{match.group(1)}.{unknown.group(1)}" if match and match.group(1) else unknown.group(1)
        return RequestError(
            f"'{name}' is not a parameter this server accepts; remove it", param=name, code="unsupported_parameter"
        )
    param = match.group(1) if match and match.group(1) else None
    missing = _MISSING.search(text)
    if missing:
        param = f"{param}.{missing.group(1)}" if param else missing.group(1)
    detail = text.split(" - at ")[0]
    where = f"'{param}'" if param else "the request body"
    return RequestError(f"invalid value for {where}: {detail}", param=param, code="invalid_value")


def parse_chat(body: bytes) -> ChatCompletionRequest:
    """Decode and check a /v1/chat/completions body."""
    request: ChatCompletionRequest = decode_body(_chat_decoder, body)
    _check_common(request)
    return request


def parse_completion(body: bytes) -> CompletionRequest:
    """Decode and check a /v1/completions body."""
    request: CompletionRequest = decode_body(_completion_decoder, body)
    _check_common(request)
    prompt = request.prompt
    if isinstance(prompt, list):
        if not prompt:
            raise RequestError("prompt is empty", param="prompt")
        if all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise RequestError("batched prompts are not supported; send one prompt per request", param="prompt")
        elif not _are_token_ids(prompt):
            bad = next((p for p in prompt if type(p) is int and not 0 <= p <= INT32_MAX), None)
            if bad is not None:
                raise RequestError(f"token id {bad} in prompt is outside 0..{INT32_MAX}", param="prompt")
            raise RequestError("prompt must be a string or a list of token ids", param="prompt")
    elif not prompt:
        raise RequestError("prompt is empty", param="prompt")
    return request


def _are_token_ids(items: list[Any]) -> bool:
    """Every item an int in 0..INT32_MAX (msgspec has refused bools), at C speed: a prompt of thousands of
    ids comes with every request, and a generator over 2,100 of them took 120 us."""
    packed = array.array("I")
    try:
        packed.fromlist(items)  # TypeError: a string among them; OverflowError: outside 0..2**32-1
    except (TypeError, OverflowError):
        return False
    return int(np.frombuffer(packed, dtype=np.uint32).max()) <= INT32_MAX


def _check_common(request: _Sampling) -> None:
    stops = stop_list(request.stop)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise RequestError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}", param="stop")
    if any(not s for s in stops):
        raise RequestError("stop sequences must be non-empty strings", param="stop")
    if request.stream_options is not None and request.stream_options.continuous_usage_stats:
        raise RequestError(
            "stream_options.continuous_usage_stats is not supported; ask for include_usage",
            param="stream_options.continuous_usage_stats",
            code="unsupported_parameter",
        )
    if request.logit_bias:
        logit_bias(request.logit_bias)
    if isinstance(request, ChatCompletionRequest) and request.top_logprobs and not request.logprobs:
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    if isinstance(request, CompletionRequest) and request.echo and request.logprobs is not None:
        raise RequestError(
            "echo with logprobs (the prompt's logprobs) is not supported; drop one",
            param="echo",
            code="unsupported_parameter",
        )


def logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's string-keyed logit_bias as token id -> bias (the vocabulary is checked once the model is known)."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or int(key) > INT32_MAX:
            raise RequestError(f"logit_bias key '{key[:20]}' is not a token id (0..{INT32_MAX})", param="logit_bias")
        out[int(key)] = value
    return out


OpenAiRequest = ChatCompletionRequest | CompletionRequest
"""A generation request of OpenAI's own two APIs (what every API at the edge becomes)."""


def requested_logprobs(request: OpenAiRequest) -> int | None:
    """Alternatives per token the request asks for (None: no logprobs)."""
    if isinstance(request, ChatCompletionRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def message_text(message: Message) -> str:
    """Plain text of a message's content (text parts joined, IMAGE_MARKER where an image part was)."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    for part in message.content:
        if part.type not in ("text", "image_url"):
            raise RequestError(
                f"content part type '{part.type}' is not supported (text and image_url)", param="messages"
            )
    return "".join(IMAGE_MARKER if part.type == "image_url" else part.text or "" for part in message.content)


def image_refs(messages: list[Message]) -> list[ImageRef]:
    """The images of a conversation, in order, each naming its content part."""
    refs = []
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type != "image_url":
                    continue
                param = f"messages[{i}].content[{j}].image_url"
                if part.image_url is None:
                    raise RequestError(f"{param} is missing: an image_url part needs one", param=param)
                refs.append(ImageRef(part.image_url.url, part.image_url.detail, param))
    return refs


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> bytes:
    """OpenAI's error JSON."""
    return msgspec.json.encode({"error": {"message": message, "type": error_type, "param": param, "code": code}})
