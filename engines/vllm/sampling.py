"""Our request's sampling fields in vLLM's terms, and vLLM's logprobs in ours: the pure part of the mapping."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from dynamo_cli.errors import RequestError
from dynamo_cli.wire import GenerateRequest, SamplingParams, TokenLogprob


def breadth(sampling: SamplingParams) -> dict[str, Any]:
    """SamplingParams for penalties, logit_bias, min_p and logprobs, where they are set."""
    kwargs: dict[str, Any] = {}
    if sampling.presence_penalty:
        kwargs["presence_penalty"] = sampling.presence_penalty
    if sampling.frequency_penalty:
        kwargs["frequency_penalty"] = sampling.frequency_penalty
    if sampling.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = sampling.repetition_penalty
    if sampling.logit_bias:
        kwargs["logit_bias"] = dict(sampling.logit_bias)
    if sampling.min_p:
        kwargs["min_p"] = sampling.min_p
    if sampling.logprobs is not None:
        kwargs["logprobs"] = sampling.logprobs
    return kwargs


def structured_outputs(cls: Any, request: GenerateRequest) -> Any:
    """`Guided` as vLLM's `StructuredOutputsParams` (`cls`; None: a vLLM without it). vLLM cannot resume a grammar
    over output made elsewhere, so a guided request migrated mid-output is refused (a decode's first token is
    generated again here, so a remote prefill's one token is fine)."""
    guided = request.sampling.guided
    assert guided is not None
    if cls is None:
        raise RequestError(f"{guided.param}: this vLLM has no structured outputs; leave it out", guided.param)
    if guided.num_accepted > (1 if request.kv_transfer is not None else 0):
        problem = f"{guided.param}: vllm cannot resume guided decoding over output made elsewhere"
        raise RequestError(problem, guided.param)
    if guided.kind == "json_object":
        return cls(json_object=True)
    return cls(json=msgspec.json.decode(guided.schema))


def logprobs(token_ids: list[int], positions: Sequence[Any], top_n: int) -> list[TokenLogprob]:
    """vLLM's per-position {token id: Logprob} (the top_n most likely plus the sampled token) as ours."""
    out = []
    for token, alternatives in zip(token_ids, positions, strict=False):
        ranked = sorted(alternatives.items(), key=lambda item: -float(item[1].logprob))
        chosen = alternatives.get(token)
        logprob = float(chosen.logprob) if chosen is not None else float("-inf")
        out.append(TokenLogprob(logprob=logprob, top=[(int(t), float(lp.logprob)) for t, lp in ranked[:top_n]]))
    return out


def vocab_size(model_config: Any) -> int:
    """vLLM's `ModelConfig.get_vocab_size()`, 0 where it has none."""
    get = getattr(model_config, "get_vocab_size", None)
    try:
        return int(get()) if get is not None else 0
    except (TypeError, ValueError, AttributeError):
        return 0
