"""What an OpenAI request asks the engines for: its prompt's token ids, its sampling settings, its plan."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import msgspec

from dynamo_cli.config.media import MediaConfig
from dynamo_cli.core.queue import QueuedRequest
from dynamo_cli.core.request_plan import RequestPlan, check_context
from dynamo_cli.engine import check_token_ids
from dynamo_cli.errors import RequestError
from dynamo_cli.frontend.media import LoadedImage, load_images
from dynamo_cli.frontend.openai import (
    IMAGE_MARKER,
    AgentHints,
    ChatCompletionRequest,
    CompletionRequest,
    image_refs,
    logit_bias,
    requested_logprobs,
    stop_list,
)
from dynamo_cli.frontend.served_models import ServedModel
from dynamo_cli.model.tokenizer import Tokenizer
from dynamo_cli.model_card import ModelCard
from dynamo_cli.routing.sessions import Session
from dynamo_cli.wire import GenerateRequest, Guided, ImageInput, ImageSpec, SamplingParams

if TYPE_CHECKING:
    from dynamo_cli.frontend.tenants import Tenancy
    from dynamo_cli.tracing.spans import RequestTrace


async def prompt_of(
    request: ChatCompletionRequest | CompletionRequest,
    tokenizer: Tokenizer,
    chat_prompt: str | None,
    images: list[LoadedImage] | None = None,
    spec: ImageSpec | None = None,
) -> tuple[list[int], int | None, str, list[ImageInput]]:
    """The prompt's token ids, the max_tokens asked (None: as many as fit), the text to echo and the images' runs
    in the ids; a chat request's prompt comes rendered (tools/chat.py), its images read (`chat_images`)."""
    if isinstance(request, ChatCompletionRequest):
        assert chat_prompt is not None
        wanted = request.max_completion_tokens or request.max_tokens
        if images:
            assert spec is not None
            ids, inputs = await with_images(tokenizer, chat_prompt, images, spec)
            return ids, wanted, "", inputs
        return await tokenizer.encode_async(chat_prompt), wanted, "", []
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and type(prompt[0]) is int:
        prompt_ids = cast(list[int], list(prompt))  # every item an int (parse_completion checked)
        check_token_ids(prompt_ids, "prompt", tokenizer.vocab_size)  # a client's ids may lie outside it
    else:
        prompt_ids = await tokenizer.encode_async(prompt if isinstance(prompt, str) else cast(str, prompt[0]))
    echo = "" if not request.echo else prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)
    return prompt_ids, request.max_tokens if request.max_tokens is not None else 16, echo, []


async def chat_images(
    request: ChatCompletionRequest, card: ModelCard, config: MediaConfig
) -> tuple[list[LoadedImage], ImageSpec | None]:
    """A chat request's images, read and checked (frontend/media.py), and how its model takes them; a model with
    no vision tower, or more images than it takes, is a 400 naming the model."""
    refs = image_refs(request.messages)
    if not refs:
        return [], card.images
    spec = card.images
    if spec is None:
        raise RequestError(f"model '{card.display_name}' takes text only; it cannot read images", param=refs[0].param)
    if len(refs) > spec.max_images:
        raise RequestError(
            f"{len(refs)} images; model '{card.display_name}' takes at most {spec.max_images} per request",
            param="messages",
        )
    return await load_images(refs, config), spec


async def with_images(
    tokenizer: Tokenizer, prompt: str, images: list[LoadedImage], spec: ImageSpec
) -> tuple[list[int], list[ImageInput]]:
    """The token ids of a rendered prompt with each IMAGE_MARKER replaced by the image's run of placeholders."""
    pieces = prompt.split(IMAGE_MARKER)
    if len(pieces) != len(images) + 1:
        raise RequestError(f"the text of the messages may not hold '{IMAGE_MARKER}'", param="messages")
    ids: list[int] = []
    inputs: list[ImageInput] = []
    for i, piece in enumerate(pieces):
        text_ids = await tokenizer.encode_async(piece) if piece else []
        if spec.token_id in text_ids:
            raise RequestError(
                "the text of the messages holds the model's image placeholder; send images as image_url parts",
                param="messages",
            )
        ids += text_ids
        if i < len(images):
            image = images[i]
            inputs.append(
                ImageInput(digest=image.digest, offset=len(ids), length=spec.tokens_per_image, data=image.data)
            )
            ids += [spec.token_id] * spec.tokens_per_image
    return ids, inputs


def sampling_of(request: ChatCompletionRequest | CompletionRequest, guided: Guided | None) -> SamplingParams:
    """The request's sampling settings, built once here and carried unchanged to every worker it reaches."""
    return SamplingParams(
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=max(0, request.top_k or 0),
        seed=request.seed,
        stop_token_ids=list(request.stop_token_ids or ()),
        ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        logit_bias=logit_bias(request.logit_bias) if request.logit_bias else {},
        min_p=request.min_p or 0.0,
        logprobs=requested_logprobs(request),
        guided=guided,
    )


def stops_of(request: ChatCompletionRequest | CompletionRequest) -> tuple[str, ...]:
    """The stop strings: the text side's (the workers see `stop_token_ids` only)."""
    return tuple(stop_list(request.stop))


def nth_seed(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s sampling: seed + index (kept in int64), so seeded choices differ yet repeat."""
    if index == 0 or sampling.seed is None:
        return sampling
    return msgspec.structs.replace(sampling, seed=(sampling.seed + index + 2**63) % 2**64 - 2**63)


def plan_request(
    entry: ServedModel,
    request_id: str,
    prompt_ids: list[int],
    max_tokens: int | None,
    sampling: SamplingParams,
    *,
    pinned_worker: int | None = None,
    is_explained: bool = False,
    client_request_id: str | None = None,
    priority: int = 0,
    deadline: float | None = None,
    trace: RequestTrace | None = None,
    lora: str = "",
    images: list[ImageInput] | None = None,
    session: Session | None = None,
    hints: AgentHints | None = None,
    tenancy: Tenancy | None = None,
) -> RequestPlan:
    """The plan of a request to `entry`'s model (with LoRA adapter `lora`, if not ""), or ContextOverflow when it
    cannot fit the context; a traced request carries its trace context to every worker (`trace.annotations`)."""
    wanted = check_context(len(prompt_ids), max_tokens, entry.card.context_length)
    request = GenerateRequest(
        request_id=request_id,
        token_ids=prompt_ids,
        max_tokens=wanted,
        sampling=sampling,
        lora=lora,
        images=images or [],
        retain_s=(hints.resume_after_s or 0.0) if hints is not None else 0.0,
        retain_key=session.id if session is not None else "",
    )
    if trace is not None:
        request = msgspec.structs.replace(request, annotations=trace.annotations)
    expected = min(hints.osl, wanted) if hints is not None and hints.osl is not None else wanted
    queued = QueuedRequest(priority, len(prompt_ids) + expected, deadline)
    if tenancy is not None:  # its tenant's share, class and queue limit
        queued = tenancy.queued(queued)
    return RequestPlan(request, pinned_worker, is_explained, client_request_id, queued, trace, session)
