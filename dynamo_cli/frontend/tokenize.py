"""`POST /tokenize` and `/detokenize` in vLLM's shapes, served by the frontend's own tokenizer (no worker hop).

A chat is rendered exactly as a chat completion's prompt is (tools/chat.py's `prepare_chat`, then `prompt_of`), so
`/tokenize`'s ids for a conversation are the ids a worker is sent for it: agent frameworks count a request's
tokens before they send it. Images are not tokenized here (a 400 naming the part): their tokens come from the
model's image processor.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from dynamo_cli.engine import check_token_ids
from dynamo_cli.errors import RequestError
from dynamo_cli.frontend.openai import (
    INT32_MAX,
    ChatCompletionRequest,
    Message,
    decode_body,
)
from dynamo_cli.frontend.prompts import prompt_of
from dynamo_cli.frontend.served_models import ServedModel
from dynamo_cli.frontend.tools.chat import prepare_chat
from dynamo_cli.frontend.tools.types import MAX_TOOLS, Tool

MAX_DETOKENIZE_IDS = 1 << 20


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's tokenize request: a completion's `prompt` or a chat's `messages` (with `tools`), one of the two."""

    model: str
    prompt: str | None = None
    messages: Annotated[list[Message], Meta(min_length=1)] | None = None
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None
    add_generation_prompt: bool = True
    """A chat: end with the assistant's turn opened, as a chat completion's prompt does."""
    return_token_strs: bool = False
    """Also each token's text."""


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    tokens: Annotated[list[Annotated[int, Meta(ge=0, le=INT32_MAX)]], Meta(max_length=MAX_DETOKENIZE_IDS)]


_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


def parse_tokenize(body: bytes) -> TokenizeRequest:
    request: TokenizeRequest = decode_body(_tokenize_decoder, body)
    if (request.prompt is None) == (request.messages is None):
        raise RequestError("send one of prompt or messages", param="prompt" if request.prompt is None else "messages")
    if request.prompt == "":
        raise RequestError("prompt is empty", param="prompt")
    if request.prompt is not None and (request.tools is not None or not request.add_generation_prompt):
        param = "tools" if request.tools is not None else "add_generation_prompt"
        raise RequestError(f"{param} applies to messages, not to a prompt", param=param)
    return request


def parse_detokenize(body: bytes) -> DetokenizeRequest:
    result: DetokenizeRequest = decode_body(_detokenize_decoder, body)
    return result


async def tokenize(entry: ServedModel, request: TokenizeRequest, parser: str) -> bytes:
    """The body of `/tokenize`: `count`, `max_model_len`, `tokens` (and `token_strs` when asked)."""
    tokenizer = await entry.tokenizer
    if request.messages is not None:
        for i, message in enumerate(request.messages):
            if isinstance(message.content, list) and any(part.type == "image_url" for part in message.content):
                raise RequestError("images are not tokenized here; send the text parts", param=f"messages[{i}]")
        chat = ChatCompletionRequest(model=request.model, messages=request.messages, tools=request.tools)
        plan = prepare_chat(
            chat, entry.card, tokenizer, parser, None, add_generation_prompt=request.add_generation_prompt
        )
        ids, _, _, _ = await prompt_of(chat, tokenizer, plan.prompt)
    else:
        assert request.prompt is not None
        ids = await tokenizer.encode_async(request.prompt)  # as prompt_of encodes a completion's text
    body: dict[str, object] = {"count": len(ids), "max_model_len": entry.card.context_length, "tokens": ids}
    body["token_strs"] = [tokenizer.hf.id_to_token(i) for i in ids] if request.return_token_strs else None
    return msgspec.json.encode(body)


async def detokenize(entry: ServedModel, request: DetokenizeRequest) -> bytes:
    """The body of `/detokenize`: the ids' text, special tokens skipped."""
    tokenizer = await entry.tokenizer
    check_token_ids(request.tokens, "tokens", tokenizer.vocab_size)
    return msgspec.json.encode({"prompt": tokenizer.decode(request.tokens)})
