"""`/v1/rerank` (and `/v2/rerank`, `/rerank`: the Cohere and Jina shape) and `/v1/score` (vLLM's), on engines that
score text pairs (Feature.SCORE).

A causal model scores as vLLM scores with one (Qwen3-Reranker's recipe): each (query, document) pair becomes a
yes/no question in the model's chat template, and its score is how much more likely the model's answer starts
with "yes" than "no" (softmax over the two tokens' logits, in 0..1). The frontend renders and tokenizes the
question once per query (the part before the document) and once per document, and sends every pair of a request
to one worker in one `score` call (wire.SCORE), held as an embedding's worker is (worker_calls.py): through the
model's queue and its busy rule, retried on another worker when one fails.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated

import msgspec
from msgspec import Meta

from dynamo_cli.core.dispatch import DispatchRules
from dynamo_cli.core.side_calls import call_worker
from dynamo_cli.engine import MAX_SCORE_PAIRS, Feature
from dynamo_cli.errors import RemoteError, RequestError
from dynamo_cli.frontend.features import require_feature
from dynamo_cli.frontend.openai import INT32_MAX, decode_body
from dynamo_cli.frontend.served_models import ServedModel
from dynamo_cli.model.tokenizer import Tokenizer
from dynamo_cli.wire import SCORE, ScorePair, ScoreRequest

MAX_DOCUMENTS = MAX_SCORE_PAIRS
SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. "
    'Note that the answer can only be "yes" or "no".'
)
INSTRUCTION = "Given a query, judge whether the document is relevant to it and answers it"
_SLOT = "\x00dyn-document\x00"
"""Where the document goes in the rendered question (split out before tokenizing)."""
RERANK_PATHS = frozenset({"/rerank", "/v1/rerank", "/v2/rerank"})
SCORE_PATHS = frozenset({"/score", "/v1/score"})


class Document(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    text: str


class RerankRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Cohere's and Jina's rerank request, as far as this server honours it."""

    model: str
    query: Annotated[str, Meta(min_length=1)]
    documents: Annotated[list[str | Document], Meta(min_length=1, max_length=MAX_DOCUMENTS)]
    top_n: Annotated[int, Meta(ge=0, le=INT32_MAX)] | None = None
    """The best this many (None or 0: every document)."""
    return_documents: bool = True
    max_tokens_per_doc: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None
    """Cohere v2's: each document cut to this many tokens before it is scored."""


TextList = Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1, max_length=MAX_DOCUMENTS)]


class ScoreTextsRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's score request: `text_1` against each of `text_2` (one to many), or pairwise (two lists as long)."""

    model: str
    text_1: Annotated[str, Meta(min_length=1)] | TextList
    text_2: Annotated[str, Meta(min_length=1)] | TextList


_rerank_decoder = msgspec.json.Decoder(RerankRequest)
_score_decoder = msgspec.json.Decoder(ScoreTextsRequest)


def parse_rerank(body: bytes) -> RerankRequest:
    request: RerankRequest = decode_body(_rerank_decoder, body)
    for i, doc in enumerate(request.documents):
        if not (doc if isinstance(doc, str) else doc.text):
            raise RequestError("a document is empty", param=f"documents[{i}]")
    return request


def parse_score(body: bytes) -> ScoreTextsRequest:
    request: ScoreTextsRequest = decode_body(_score_decoder, body)
    firsts, seconds = _as_list(request.text_1), _as_list(request.text_2)
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise RequestError(
            f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: send one text_1, or as many as text_2",
            param="text_2",
        )
    return request


async def rerank(entry: ServedModel, request: RerankRequest, rules: DispatchRules) -> bytes:
    """The response body: the documents' results, most relevant first (the best `top_n`)."""
    texts = [doc if isinstance(doc, str) else doc.text for doc in request.documents]
    scores, tokens = await _scores(entry, [(request.query, t) for t in texts], rules, request.max_tokens_per_doc)
    order = sorted(range(len(texts)), key=lambda i: -scores[i])[: request.top_n or None]
    results: list[dict[str, object]] = []
    for i in order:
        result: dict[str, object] = {"index": i, "relevance_score": scores[i]}
        if request.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    return msgspec.json.encode(
        {"id": "rerank-" + uuid.uuid4().hex, "model": entry.name, "usage": {"total_tokens": tokens}, "results": results}
    )


async def score(entry: ServedModel, request: ScoreTextsRequest, rules: DispatchRules) -> bytes:
    """The response body: one score per pair, in order."""
    firsts, seconds = _as_list(request.text_1), _as_list(request.text_2)
    pairs = list(zip(firsts * len(seconds) if len(firsts) == 1 else firsts, seconds, strict=True))
    scores, tokens = await _scores(entry, pairs, rules, None)
    return msgspec.json.encode(
        {
            "id": "score-" + uuid.uuid4().hex,
            "object": "list",
            "created": int(time.time()),
            "model": entry.name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


async def _scores(
    entry: ServedModel, texts: list[tuple[str, str]], rules: DispatchRules, doc_limit: int | None
) -> tuple[list[float], int]:
    """Each (query, document) pair's score from a worker of the model, and the prompt tokens they took."""
    card = entry.card
    require_feature(
        entry, Feature.SCORE, "scores no text pairs", "serve it on an engine that scores (llamacpp, mocker)"
    )
    tokenizer = await entry.tokenizer
    candidates = candidate_ids(tokenizer, entry.name)
    heads: dict[str, tuple[list[int], list[int]]] = {}
    pairs = []
    for i, (query, doc) in enumerate(texts):
        if query not in heads:
            heads[query] = await question_ids(tokenizer, query)
        head, tail = heads[query]
        body = await tokenizer.encode_async(" " + doc)
        second = (body[:doc_limit] if doc_limit else body) + tail
        if len(head) + len(second) > card.context_length:
            raise RequestError(
                f"query and document together are {len(head) + len(second)} tokens; this model scores "
                f"{card.context_length}",
                param=f"documents[{i}]",
            )
        pairs.append(ScorePair(first=head, second=second))
    request_id = "score-" + uuid.uuid4().hex
    reply = await call_worker(
        entry, SCORE, ScoreRequest(request_id=request_id, pairs=pairs, candidates=candidates), request_id, rules
    )
    if len(reply.scores) != len(pairs):
        raise RemoteError(f"a worker scored {len(reply.scores)} of {len(pairs)} pairs")
    return reply.scores, sum(len(p.first) + len(p.second) for p in pairs)


async def question_ids(tokenizer: Tokenizer, query: str) -> tuple[list[int], list[int]]:
    """The yes/no question about `query`, tokenized: the part before the document, and the part after it."""
    user = f"<Instruct>: {INSTRUCTION}\n<Query>: {query}\n<Document>:{_SLOT}"
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])
    head, _, tail = rendered.partition(_SLOT)
    return await tokenizer.encode_async(head), tokenizer.encode(tail)


def candidate_ids(tokenizer: Tokenizer, model: str) -> list[int]:
    ids = [tokenizer.encode(word) for word in ("yes", "no")]
    if any(len(x) != 1 for x in ids):
        raise RequestError(f"model '{model}' has no one-token 'yes' and 'no' to score with", param="model")
    return [ids[0][0], ids[1][0]]


def _as_list(text: str | list[str]) -> list[str]:
    return [text] if isinstance(text, str) else text
