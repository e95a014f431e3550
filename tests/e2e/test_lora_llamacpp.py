"""Real LoRA adapters on llama.cpp through `dyn serve`: SmolLM2 with two synthetic GGUF adapters made here (no hub),
asked through the official `openai` client; a bad adapter file is a 400 naming its problem, and serving goes on."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from dyn_engines.llamacpp.adapters import write_adapter

from dynamo_cli.model.paths import resolve_model_path
from tests.conftest import DynProcess

pytestmark = pytest.mark.llamacpp

QUESTION = [{"role": "user", "content": "What color is the sky on a clear day?"}]


@pytest.fixture(scope="module")
def served(dyn_serve_module, tmp_path_factory: pytest.TempPathFactory) -> DynProcess:  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp("adapters")
    model = str(resolve_model_path("smollm2"))
    for seed, name in enumerate(("one", "two")):
        write_adapter(str(folder / f"{name}.gguf"), model, seed=seed)
    (folder / "junk.gguf").write_bytes(b"GGUF" + bytes(200))
    flags = ["--engine", "llamacpp", "--lora", f"one={folder / 'one.gguf'}", "--lora-dir", str(folder)]
    served = dyn_serve_module(*flags)
    served.folder = folder  # type: ignore[attr-defined]
    return served  # type: ignore[no-any-return]


def answer(client: openai.OpenAI, model: str) -> str:
    reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24, temperature=0)  # type: ignore[arg-type]
    assert reply.model == model
    return reply.choices[0].message.content or ""


def test_an_adapter_changes_the_greedy_answer_and_each_answer_is_repeatable(served: DynProcess) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=served.api_key, max_retries=0, timeout=60)
    folder: Path = served.folder  # type: ignore[attr-defined]
    base = answer(client, "smollm2")
    assert "blue" in base.lower()
    one = answer(client, "one")
    loaded = client.post(
        "/load_lora_adapter", body={"lora_name": "two", "lora_path": str(folder / "two.gguf")}, cast_to=httpx.Response
    )
    assert loaded.status_code == 200
    two = answer(client, "two")
    assert len({base, one, two}) == 3, (base, one, two)
    assert [answer(client, m) for m in ("two", "smollm2", "one")] == [two, base, one]


def test_a_file_that_is_no_adapter_is_a_400_naming_the_problem_and_the_worker_serves_on(served: DynProcess) -> None:
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=served.api_key, max_retries=0, timeout=60)
    folder: Path = served.folder  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as refused:
        client.post(
            "/load_lora_adapter",
            body={"lora_name": "junk", "lora_path": str(folder / "junk.gguf")},
            cast_to=httpx.Response,
        )
    assert refused.value.body["param"] == "lora_path"  # type: ignore[index]
    assert "junk.gguf" in refused.value.message or "GGUF" in refused.value.message
    assert "junk" not in {m.id for m in client.models.list().data}
    assert "blue" in answer(client, "smollm2").lower()
    # the refused file bound nothing to the name: a good file loads under it
    fixed = client.post(
        "/load_lora_adapter", body={"lora_name": "junk", "lora_path": str(folder / "one.gguf")}, cast_to=httpx.Response
    )
    assert fixed.status_code == 200
    client.post("/unload_lora_adapter", body={"lora_name": "junk"}, cast_to=httpx.Response)
