"""The OpenAI surface on a mocker deployment, with the official client: two models behind one frontend,
n choices, (fake) logprobs, /v1/responses, /openapi.json, and the rule that nothing accepted is ignored
(a property test of bodies generated from /openapi.json: never a 5xx, and a field the mocker's card does
not honour is a 400 naming it)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import DynProcess, wait_until

SECRET = "5e" * 32
MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def served(dyn_serve_module, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DynProcess]:  # type: ignore[no-untyped-def]
    """`dyn serve` of model alpha, and a `dyn worker` of model beta joining its planes."""
    disc = f"file://{tmp_path_factory.mktemp('disc')}"
    env = {"DYN_CLUSTER_SECRET": SECRET}
    d: DynProcess = dyn_serve_module(
        "--engine", "mocker", "--served-model-name", "alpha", "--speedup-ratio", "100", discovery=disc, env=env
    )
    beta = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dynamo_cli.cli.main",
            "worker",
            "--engine",
            "mocker",
            "--served-model-name",
            "beta",
            "--speedup-ratio",
            "100",
            "--discovery",
            disc,
            "--events",
            "embedded",
        ],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert wait_until(lambda: len(models(d)) == 2, timeout=60), models(d)
        yield d
    finally:
        beta.terminate()
        beta.wait(15)


def models(d: DynProcess) -> list[str]:
    return sorted(m["id"] for m in httpx.get(f"{d.url}/v1/models", headers=d.auth, timeout=10).json()["data"])


def client(d: DynProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.api_key, max_retries=0, timeout=60)


def test_one_frontend_serves_two_models_each_on_its_own_workers(served: DynProcess) -> None:
    assert models(served) == ["alpha", "beta"]
    records = {r.instance_id: r for r in served.instance_records() if r.component != "router"}
    seen = {}
    for model in ("alpha", "beta"):
        raw = client(served).chat.completions.with_raw_response.create(model=model, messages=MESSAGES, max_tokens=3)
        assert raw.parse().model == model
        seen[model] = int(raw.headers["x-worker-instance-id"], 16)
    assert seen["alpha"] != seen["beta"] and set(seen.values()) <= set(records)


def test_n_three_returns_three_choices_unary_and_streamed(served: DynProcess) -> None:
    reply = client(served).chat.completions.create(model="alpha", messages=MESSAGES, max_tokens=4, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage is not None and reply.usage.completion_tokens == 12
    stream = client(served).completions.create(
        model="alpha", prompt="x", max_tokens=4, n=3, stream=True, stream_options={"include_usage": True}
    )
    texts, finished, usage = ["", "", ""], set(), None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2} and all(texts) and usage is not None and usage.completion_tokens == 12


def test_mocker_logprobs_are_deterministic_fakes_in_openai_shape(served: DynProcess) -> None:
    reply = client(served).chat.completions.create(
        model="alpha", messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert all(e.logprob == e.top_logprobs[0].logprob and len(e.top_logprobs) == 2 for e in content)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1.0),
        ("repetition_penalty", 1.2),
        ("min_p", 0.1),
        ("logit_bias", {"42": 3}),
    ],
)
def test_a_field_the_engine_does_not_honour_is_a_400_naming_it_and_the_engine(
    served: DynProcess, field: str, value: object
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(served).chat.completions.create(
            model="alpha", messages=MESSAGES, max_tokens=2, extra_body={field: value}
        )
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == field and "mocker" in error["message"]
    neutral = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "min_p": 0, "logit_bias": {}}
    # the no-op value asks nothing, so any engine takes it
    client(served).chat.completions.create(
        model="alpha", messages=MESSAGES, max_tokens=2, extra_body={field: neutral[field]}
    )


def test_responses_unary_and_streamed(served: DynProcess) -> None:
    reply = client(served).responses.create(model="alpha", input="Say hi", instructions="Be brief", max_output_tokens=5)
    assert reply.status == "incomplete" and reply.output_text and reply.usage is not None
    assert reply.usage.output_tokens == 5
    kinds, deltas = [], []
    for event in client(served).responses.create(
        model="beta", input=[{"role": "user", "content": "Say hi"}], max_output_tokens=4, stream=True
    ):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert "response.output_text.done" in kinds and len(deltas) >= 1
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client(served).responses.create(model="alpha", input="x", previous_response_id="resp_1")


def test_anthropic_messages_unary_and_streamed(served: DynProcess) -> None:
    body = {"model": "alpha", "max_tokens": 4, "system": "Be brief", "messages": [{"role": "user", "content": "Hi"}]}
    reply = httpx.post(f"{served.url}/v1/messages", headers=served.auth, json=body, timeout=30).json()
    assert reply["type"] == "message" and reply["role"] == "assistant" and reply["stop_reason"] == "max_tokens"
    assert reply["content"][0]["type"] == "text" and reply["content"][0]["text"]
    assert reply["usage"]["output_tokens"] == 4 and reply["usage"]["input_tokens"] > 0
    with httpx.stream(
        "POST", f"{served.url}/v1/messages", headers=served.auth, json={**body, "stream": True}, timeout=30
    ) as stream:
        events = [line.removeprefix("event: ") for line in stream.iter_lines() if line.startswith("event: ")]
    assert events[:2] == ["message_start", "content_block_start"] and events[-2:] == ["message_delta", "message_stop"]
    assert events.count("content_block_delta") >= 1


def test_anthropic_clients_get_errors_in_anthropics_shape(served: DynProcess) -> None:
    client = anthropic.Anthropic(base_url=served.url, api_key=served.api_key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="alpha", max_tokens=-1, messages=[{"role": "user", "content": "Hi"}])
    assert bad.value.body["type"] == "error"  # type: ignore[index]
    error = bad.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error" and "max_tokens" in error["message"], error
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    stranger = anthropic.Anthropic(base_url=served.url, api_key="sk-not-a-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        stranger.messages.create(model="alpha", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    chat = httpx.post(f"{served.url}/v1/chat/completions", headers=served.auth, json={"model": "alpha"}, timeout=10)
    assert chat.status_code == 400 and "param" in chat.json()["error"]  # OpenAI's shape stays OpenAI's


def test_embeddings_on_an_engine_without_them_is_a_400_naming_the_model(served: DynProcess) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(served).embeddings.create(model="alpha", input="x")
    assert info.value.body["param"] == "model" and "mocker" in info.value.body["message"]  # type: ignore[index]


##### Property test: bodies from /openapi.json #####


def schema_strategy(schema: dict[str, Any], components: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """Values valid for `schema` (the subset of JSON Schema msgspec emits), mostly small."""
    if "$ref" in schema:
        return schema_strategy(components[schema["$ref"].rsplit("/", 1)[1]], components, depth + 1)
    if "anyOf" in schema:
        return st.one_of([schema_strategy(s, components, depth + 1) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return st.integers(max(schema.get("minimum", -(2**63)), -5), min(schema.get("maximum", 2**63 - 1), 8))
    if kind == "number":
        low, high = schema.get("minimum", schema.get("exclusiveMinimum", -10.0)), schema.get("maximum", 10.0)
        return st.floats(low, high, exclude_min="exclusiveMinimum" in schema, allow_nan=False)
    if kind == "string":
        return st.text(max_size=12)
    if kind == "array":
        items = schema_strategy(schema.get("items", {"type": "string"}), components, depth + 1)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=3)
    if kind == "object" and "properties" in schema:
        required = {k: schema_strategy(schema["properties"][k], components, depth + 1) for k in schema["required"]}
        optional = {
            k: schema_strategy(v, components, depth + 1)
            for k, v in schema["properties"].items()
            if k not in schema["required"]
        }
        return st.fixed_dictionaries(required, optional=optional)
    if kind == "object":
        values = schema_strategy(schema.get("additionalProperties", {"type": "string"}), components, depth + 1)
        return st.dictionaries(st.text(max_size=4), values, max_size=2)
    return st.none()


@pytest.fixture(scope="module")
def document(served: DynProcess) -> dict[str, Any]:
    return httpx.get(f"{served.url}/openapi.json", headers=served.auth, timeout=10).json()  # type: ignore[no-any-return]


def test_openapi_describes_every_route_the_server_accepts(served: DynProcess, document: dict[str, Any]) -> None:
    paths = document["paths"]
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/embeddings",
        "/v1/rerank",
        "/v1/score",
        "/tokenize",
        "/detokenize",
        "/v1/models",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/v1/loras",
        "/health",
        "/openapi.json",
    } <= set(paths)
    chat = document["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["additionalProperties"] is False and "logit_bias" in chat["properties"]
    assert {"/v1/files", "/v1/files/{file_id}/content", "/v1/batches", "/v1/batches/{batch_id}/cancel"} <= set(paths)
    for path, item in paths.items():  # every documented route exists: a body-less POST is a 400, not a 404
        for method in item:
            response = httpx.request(method.upper(), f"{served.url}{path}", headers=served.auth, timeout=10)
            if "{" in path:  # no such file or batch: a 404 naming the parameter, not a route missing
                assert response.status_code == 404 and response.json()["error"]["param"] in ("file_id", "batch_id")
            else:
                assert response.status_code in (200, 400), (path, method, response.status_code)


UNHONOURED = {"presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias"}
NO_OP = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "min_p": 0, "logit_bias": {}}


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_bodies_from_the_openapi_document_never_5xx_and_unhonoured_fields_are_refused(
    served: DynProcess, document: dict[str, Any], data: st.DataObject
) -> None:
    components = document["components"]["schemas"]
    with_body = sorted(p for p, item in document["paths"].items() if "requestBody" in item.get("post", {}))
    path = data.draw(st.sampled_from(with_body))
    schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    body = data.draw(schema_strategy(schema, components))
    body["model"] = data.draw(st.sampled_from(["alpha", "beta"]))
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n"):  # keep each request short
        if isinstance(body.get(key), int):
            body[key] = min(body[key], 4)
    reply = httpx.post(f"{served.url}{path}", headers=served.auth, json=body, timeout=30)
    assert reply.status_code < 500, (body, reply.text)
    asked = {k for k in UNHONOURED if k in body and body[k] is not None and body[k] != NO_OP[k]}
    if asked:  # never accepted; refused for that field (naming the engine) unless another field failed first
        assert reply.status_code == 400, (body, reply.text)
        error = reply.json()["error"]
        if error["code"] == "unsupported_parameter" and error["param"] in UNHONOURED:
            assert error["param"] in asked and "mocker" in error["message"], (body, reply.text)


def test_unknown_fields_are_refused_by_name(served: DynProcess) -> None:
    reply = httpx.post(
        f"{served.url}/v1/chat/completions",
        headers=served.auth,
        json={"model": "alpha", "messages": MESSAGES, "best_of": 2},
        timeout=10,
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "best_of"


def _counted(d: DynProcess, series: str) -> float:
    """The sum of a /metrics series over the label sets that contain every `key="value"` given in `series`."""
    name, _, wanted = series.partition("{")
    labels = [label for label in wanted.rstrip("}").split(",") if label]
    text = httpx.get(f"{d.url}/metrics", headers=d.auth, timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and all(label in line for label in labels)
    )


LONG = 4000
LEAVING = {
    "chat_completions": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": LONG, "n": 2, "stream": True}),
    "completions": ("/v1/completions", {"prompt": "Once", "max_tokens": LONG, "stream": True}),
    "responses": ("/v1/responses", {"input": "Say hi", "max_output_tokens": LONG, "stream": True}),
    "messages": ("/v1/messages", {"messages": MESSAGES, "max_tokens": LONG, "stream": True}),
}


def test_a_client_that_leaves_mid_stream_is_counted_as_gone_whatever_its_api(served: DynProcess) -> None:
    gone = 'dynamo_frontend_disconnected_clients_total{model="alpha"'
    before = _counted(served, gone)
    cancelled = {api: f'dynamo_frontend_requests_total{{endpoint="{api}",status="cancelled"' for api in LEAVING}
    cancelled_before = {api: _counted(served, series) for api, series in cancelled.items()}
    for path, body in LEAVING.values():
        with httpx.stream(
            "POST", f"{served.url}{path}", headers=served.auth, json={"model": "alpha", **body}, timeout=30
        ) as stream:
            lines = stream.iter_lines()  # one event with text, then the client leaves mid-stream
            assert any(line.startswith("data:") and len(line) > 40 for line in lines)
    assert wait_until(lambda: _counted(served, gone) >= before + len(LEAVING), timeout=10), _counted(served, gone)
    for api, series in cancelled.items():
        assert _counted(served, series) == cancelled_before[api] + 1, api
