"""OpenAI's Batch API on the real model (llama.cpp, SmolLM2-135M): a 60-line batch with 5 malformed lines gives
55 outputs and 5 errors, and each output is what the same request gives interactively at temperature 0."""

from __future__ import annotations

import io
import json
import time
from typing import Any

import openai
import pytest

from tests.conftest import DynProcess

pytest.importorskip("llama_cpp")

CHAT = "/v1/chat/completions"
LINES = 60
"""Each question 12 times (11 for the two a malformed line replaces once): 200 lines took 76 s of the suite and
proved nothing 60 do not."""
QUESTIONS = ["What color is the sky on a clear day?", "Name a fruit.", "What is 2 + 2?", "Say hello.", "Name a color."]


def body(i: int) -> dict[str, Any]:
    question = QUESTIONS[i % len(QUESTIONS)]
    tokens = 24 if i % len(QUESTIONS) == 0 else 6  # the sky's answer ends in its color
    return {
        "model": "smollm2",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": tokens,
        "temperature": 0,
    }


@pytest.fixture(scope="module")
def served(dyn_serve_module, tmp_path_factory: pytest.TempPathFactory) -> DynProcess:  # type: ignore[no-untyped-def]
    database = tmp_path_factory.mktemp("batch") / "batches.db"
    # one llama.cpp worker; --deterministic: the same tokens at temperature 0 alone or batched (llama.cpp
    # batches numerics differently otherwise, and a near tie between two tokens can then flip)
    return dyn_serve_module("--deterministic", env={"DYN_BATCH_DB": str(database)})


@pytest.mark.timeout(300)  # the batch may take its 240 s below on a loaded machine (the default 120 s cut it off)
def test_a_batch_on_the_real_model_answers_as_interactive_requests_do(served: DynProcess) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=served.api_key, max_retries=0, timeout=60)
    bad = {3: "{", 14: json.dumps({"custom_id": "x14"}), 27: "[1, 2]", 40: "null", 53: '"text"'}
    lines = [
        bad.get(i) or json.dumps({"custom_id": f"q{i}", "method": "POST", "url": CHAT, "body": body(i)})
        for i in range(LINES)
    ]
    upload = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    deadline = time.monotonic() + 240
    while batch.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (LINES - 5, 5)
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]  # type: ignore[arg-type]
    errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]  # type: ignore[arg-type]
    assert len(out) == LINES - 5 and len(errors) == 5
    assert all(e["response"]["status_code"] == 400 for e in errors)
    answers = {r["custom_id"]: r["response"]["body"]["choices"][0]["message"]["content"] for r in out}
    for i in range(len(QUESTIONS)):  # each question, asked alone, gets the answer its batch lines got
        alone = client.chat.completions.create(**body(i)).choices[0].message.content
        assert {answers[f"q{j}"] for j in range(i, LINES, len(QUESTIONS)) if f"q{j}" in answers} == {alone}
    assert "blue" in answers["q0"].lower()
