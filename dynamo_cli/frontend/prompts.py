"""What an OpenAI request asks the engines for: its prompt's token ids and its sampling settings."""

from __future__ import annotations

import dataclasses
from typing import cast

from dynamo_cli.engine import Guided, check_token_ids
from dynamo_cli.frontend.dispatch import Sampling
from dynamo_cli.frontend.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    logit_bias,
    requested_logprobs,
    stop_list,
)
from dynamo_cli.model.tokenizer import Tokenizer


def prompt_of(
    request: ChatCompletionRequest | CompletionRequest, tokenizer: Tokenizer, chat_prompt: str | None
) -> tuple[list[int], int | None, str]:
    """The prompt's token ids, the max_tokens asked (None: as many as fit) and the text to echo; a chat
    request's prompt comes rendered (tools/chat.py)."""
    if isinstance(request, ChatCompletionRequest):
        assert chat_prompt is not None
        return tokenizer.encode(chat_prompt), request.max_completion_tokens or request.max_tokens, ""
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and type(prompt[0]) is int:
        prompt_ids = cast(list[int], list(prompt))  # every item an int (parse_completion checked)
        check_token_ids(prompt_ids, "prompt", tokenizer.vocab_size)  # a client's ids may lie outside it
    else:
        prompt_ids = tokenizer.encode(prompt if isinstance(prompt, str) else cast(str, prompt[0]))
    echo = "" if not request.echo else prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)
    return prompt_ids, request.max_tokens if request.max_tokens is not None else 16, echo


def sampling_of(
    request: ChatCompletionRequest | CompletionRequest, max_tokens: int | None, guided: Guided | None
) -> Sampling:
    return Sampling(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=max(0, request.top_k or 0),
        seed=request.seed,
        stop=tuple(stop_list(request.stop)),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        logit_bias=tuple(logit_bias(request.logit_bias).items()) if request.logit_bias else (),
        min_p=request.min_p or 0.0,
        logprobs=requested_logprobs(request),
        guided=guided,
    )


def nth_seed(sampling: Sampling, index: int) -> Sampling:
    """Choice `index`'s sampling: seed + index (kept in int64), so seeded choices differ yet repeat."""
    if index == 0 or sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index + 2**63) % 2**64 - 2**63)
