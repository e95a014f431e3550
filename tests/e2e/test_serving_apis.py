"""Rerank, score, tokenize and detokenize on a real `dyn serve` of two mocker workers: the Cohere/Jina and vLLM
request and response shapes, ordering and `top_n`, each bad field a 400 naming it, and each API counted in
/metrics. The mocker's score of a (query, document) pair is the share of the document's tokens (and the
question's end) that the query's side has too, so a document that repeats the query ranks first."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.conftest import DynProcess, wait_until

MODEL = "alpha"
QUERY = "What colour is the sky over the sea?"
DOCUMENTS = ["Bananas grow in warm places.", "The sky over the sea is blue.", "Trains run on rails."]


@pytest.fixture(scope="module")
def served(dyn_serve_module) -> DynProcess:  # type: ignore[no-untyped-def]
    d: DynProcess = dyn_serve_module(
        "--engine", "mocker", "--workers", "2", "--served-model-name", MODEL, "--speedup-ratio", "100"
    )
    assert wait_until(lambda: _get(d, "/health").get("instances", []).__len__() == 2, timeout=60)
    return d


def _get(d: DynProcess, path: str) -> Any:
    return httpx.get(f"{d.url}{path}", headers=d.auth, timeout=10).json()


def _post(d: DynProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{d.url}{path}", headers=d.auth, json=body, timeout=30)


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank", "/rerank"])
def test_rerank_orders_the_documents_and_keeps_the_best_top_n(served: DynProcess, path: str) -> None:
    reply = _post(served, path, {"model": MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["model"] == MODEL and body["id"].startswith("rerank-") and body["usage"]["total_tokens"] > 0
    results = body["results"]
    assert [r["index"] for r in results][:1] == [1] and len(results) == 2
    assert results[0]["relevance_score"] > results[1]["relevance_score"]
    assert all(0.0 <= r["relevance_score"] <= 1.0 for r in results)
    assert results[0]["document"] == {"text": DOCUMENTS[1]}


def test_rerank_takes_document_objects_and_can_leave_the_texts_out(served: DynProcess) -> None:
    objects = [{"text": text} for text in DOCUMENTS]
    plain = _post(served, "/v1/rerank", {"model": MODEL, "query": QUERY, "documents": DOCUMENTS}).json()
    bare = _post(
        served, "/v1/rerank", {"model": MODEL, "query": QUERY, "documents": objects, "return_documents": False}
    ).json()
    assert [r["index"] for r in bare["results"]] == [r["index"] for r in plain["results"]]
    assert len(bare["results"]) == 3 and all("document" not in r for r in bare["results"])
    assert [r["relevance_score"] for r in bare["results"]] == [r["relevance_score"] for r in plain["results"]]


def test_score_one_to_many_and_pairwise_agree_with_rerank(served: DynProcess) -> None:
    ranked = _post(served, "/v1/rerank", {"model": MODEL, "query": QUERY, "documents": DOCUMENTS}).json()["results"]
    by_index = {r["index"]: r["relevance_score"] for r in ranked}
    many = _post(served, "/v1/score", {"model": MODEL, "text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert many["object"] == "list" and [d["index"] for d in many["data"]] == [0, 1, 2]
    assert [d["score"] for d in many["data"]] == [by_index[i] for i in range(3)]
    pairwise = _post(served, "/score", {"model": MODEL, "text_1": [QUERY] * 3, "text_2": DOCUMENTS}).json()
    assert [d["score"] for d in pairwise["data"]] == [d["score"] for d in many["data"]]
    assert pairwise["usage"]["prompt_tokens"] == many["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/v1/rerank", {"query": "", "documents": DOCUMENTS}, "query"),
        ("/v1/rerank", {"query": QUERY, "documents": ["ok", ""]}, "documents[1]"),
        ("/v1/rerank", {"query": QUERY, "documents": [{"txt": "x"}]}, "documents[0].txt"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": -1}, "top_n"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "rank_fields": ["a"]}, "rank_fields"),
        ("/v1/rerank", {"query": QUERY, "documents": ["x " * 9000]}, "documents[0]"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
        ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ("/tokenize", {"prompt": "hi", "add_generation_prompt": False}, "add_generation_prompt"),
        ("/tokenize", {"prompt": ""}, "prompt"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
            "messages[0]",
        ),
        ("/tokenize", {"prompt": "hi", "add_special_tokens": True}, "add_special_tokens"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_each_bad_field_is_a_400_naming_it(served: DynProcess, path: str, body: dict[str, Any], param: str) -> None:
    reply = _post(served, path, {"model": MODEL, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text


def test_an_unknown_model_is_a_404_and_a_body_that_is_no_json_a_400(served: DynProcess) -> None:
    for path in ("/v1/rerank", "/v1/score", "/tokenize", "/detokenize"):
        assert _post(served, path, {"model": "nope", "prompt": "x", "tokens": [1]}).status_code in (400, 404)
        reply = httpx.post(f"{served.url}{path}", headers=served.auth, content=b"{", timeout=10)
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"


def test_tokenize_counts_a_chat_as_the_chat_completion_does_and_detokenize_reverses_a_prompt(
    served: DynProcess,
) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    tokens = _post(served, "/tokenize", {"model": MODEL, "messages": messages, "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) and tokens["max_model_len"] > 0
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=served.api_key, max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert chat.usage is not None and chat.usage.prompt_tokens == tokens["count"]
    opened = _post(served, "/tokenize", {"model": MODEL, "messages": messages, "add_generation_prompt": False})
    assert opened.json()["count"] < tokens["count"]  # the assistant's turn is not opened
    text = "The sky is blue."
    ids = _post(served, "/tokenize", {"model": MODEL, "prompt": text}).json()["tokens"]
    completion = client.completions.create(model=MODEL, prompt=text, max_tokens=2)
    assert completion.usage is not None and completion.usage.prompt_tokens == len(ids)
    assert _post(served, "/detokenize", {"model": MODEL, "tokens": ids}).json() == {"prompt": text}


def test_each_api_is_counted_in_the_metrics(served: DynProcess) -> None:
    _post(served, "/v1/rerank", {"model": MODEL, "query": QUERY, "documents": DOCUMENTS})
    _post(served, "/tokenize", {"model": MODEL, "prompt": "x"})
    text = httpx.get(f"{served.url}/metrics", headers=served.auth, timeout=10).text
    for api in ("rerank", "tokenize"):
        assert any(
            line.startswith("dynamo_frontend_requests_total{") and f'"{api}"' in line and 'status="success"' in line
            for line in text.splitlines()
        ), api
