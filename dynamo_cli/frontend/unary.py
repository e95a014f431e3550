"""The APIs beside generation's that answer with one JSON body: embeddings, rerank and score (on a worker), tokenize
and detokenize (the frontend's tokenizer). Each is a parser and a runner; the edge's lifecycle (lifecycle.py
`Lifecycle.unary`) reads, parses, resolves the model, runs and counts every one the same way."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from dynamo_cli.config import FrontendConfig
from dynamo_cli.core.dispatch import DispatchRules
from dynamo_cli.frontend.embeddings import embed, parse_embeddings
from dynamo_cli.frontend.scoring import RERANK_PATHS, SCORE_PATHS, parse_rerank, parse_score, rerank, score
from dynamo_cli.frontend.served_models import ServedModel
from dynamo_cli.frontend.tokenize import detokenize, parse_detokenize, parse_tokenize, tokenize


@dataclass(frozen=True, slots=True)
class UnaryApi:
    name: str
    """Its label in the frontend's request counts."""
    parse: Callable[[bytes], Any]
    """The body as its request (a struct with a `model`); RequestError naming the field."""
    run: Callable[[ServedModel, Any, DispatchRules, FrontendConfig], Awaitable[bytes]]
    """The response body."""
    adapters: bool = False
    """A LoRA adapter's name may stand for its base model (the tokenizer is the base's)."""


_RERANK = UnaryApi("rerank", parse_rerank, lambda entry, request, rules, _: rerank(entry, request, rules))
_SCORE = UnaryApi("score", parse_score, lambda entry, request, rules, _: score(entry, request, rules))
UNARY_APIS: dict[str, UnaryApi] = {
    "/v1/embeddings": UnaryApi(
        "embeddings", parse_embeddings, lambda entry, request, rules, _: embed(entry, request, rules)
    ),
    **dict.fromkeys(RERANK_PATHS, _RERANK),
    **dict.fromkeys(SCORE_PATHS, _SCORE),
    "/tokenize": UnaryApi(
        "tokenize",
        parse_tokenize,
        lambda entry, request, _, config: tokenize(entry, request, config.tool_call_parser),
        adapters=True,
    ),
    "/detokenize": UnaryApi(
        "detokenize", parse_detokenize, lambda entry, request, *_: detokenize(entry, request), adapters=True
    ),
}
"""POST path -> its API."""
