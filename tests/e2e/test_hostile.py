"""One hostile request harms no one: generated request bodies against a real `dyn serve` (two mocker workers).

Every answer is OpenAI-shaped: a 4xx/503 with a JSON error body, or a 200 whose stream ends with
`data: [DONE]`; never a 5xx for client input, never a cut stream; both workers stay alive throughout.
Hypothesis generates the bodies with a fixed seed and a bounded count, so the suite is repeatable.
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import DynProcess

INT_EDGES = [0, -1, 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, -(2**64), 10**40]
FIELDS = [
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_tokens",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "n",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "user",
    "logprobs",
    "top_logprobs",
    "echo",
    "messages",
    "prompt",
    "unknown",
]


DEEP = {'"@deep40"': b"[" * 40 + b"]" * 40, '"@deep5000"': b"[" * 5000 + b"]" * 5000}
"""Stand-ins swapped for raw nested arrays after json.dumps (which, like Hypothesis' printer, recurses)."""


def encode(body: dict[str, Any]) -> bytes:
    raw = json.dumps(body, ensure_ascii=True).encode()  # lone surrogates travel as \\ud800 escapes
    for marker, nested in DEEP.items():
        raw = raw.replace(marker.encode(), nested)
    return raw


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(INT_EDGES),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from(["\ud800", "\udfff", "\x00", "smollm2", ""]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10,
) | st.sampled_from(["@deep40", "@deep5000"])
token_ids = st.lists(st.one_of(st.integers(0, 49151), st.sampled_from(INT_EDGES)), min_size=1, max_size=8)


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """A valid request, then some of its fields replaced by hostile values."""
    is_chat = draw(st.booleans())
    body: dict[str, Any] = {"model": "smollm2", "max_tokens": draw(st.integers(1, 8)), "stream": draw(st.booleans())}
    if is_chat:
        body["messages"] = [{"role": "user", "content": draw(st.text(max_size=30))}]
    else:
        body["prompt"] = draw(st.one_of(st.text(min_size=1, max_size=30), token_ids))
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True)):
        body[name] = draw(values)
    return ("/v1/chat/completions" if is_chat else "/v1/completions"), body


def check_answer(response: httpx.Response, stream: bool) -> None:
    """OpenAI-shaped whatever the input: no 5xx; errors are JSON; streams end with [DONE]."""
    assert response.status_code < 500 or response.status_code == 503, response.text[:300]
    if response.status_code != 200:
        error = response.json()["error"]
        assert error["message"] and error["type"]
        return
    if stream:
        assert response.text.rstrip().endswith("data: [DONE]"), response.text[-300:]
    else:
        assert response.json()["choices"]


@pytest.fixture(scope="module")
def deployment(dyn_serve_module) -> Iterator[DynProcess]:  # type: ignore[no-untyped-def]
    yield dyn_serve_module("--engine", "mocker", "--workers", "2", "--speedup-ratio", "100")


def _workers(url: str) -> int:
    return len(httpx.get(f"{url}/health", timeout=10).json().get("instances", []))


@settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=bodies())
def test_generated_bodies_get_openai_shaped_answers(deployment: DynProcess, case: tuple[str, dict[str, Any]]) -> None:
    path, body = case
    response = httpx.post(
        deployment.url + path,
        content=encode(body),
        headers={**deployment.auth, "content-type": "application/json"},
        timeout=30,
    )
    check_answer(response, stream=body.get("stream") is True)


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b'{"model": "smollm2", "prompt": "\xff\xfe"}', id="invalid-utf8"),
        pytest.param(
            b'{"model": "smollm2", "prompt": "x", "a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", id="nested-100k"
        ),
        pytest.param(b'{"model": "smollm2", "prompt": ', id="truncated"),
        pytest.param(b"\x00\x01\x02", id="binary"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_malformed_bodies_are_400s(deployment: DynProcess, raw: bytes, stream: bool) -> None:
    raw = raw.replace(b'"prompt": "x"', b'"prompt": "x", "stream": true') if stream else raw
    response = httpx.post(f"{deployment.url}/v1/completions", content=raw, timeout=30, headers=deployment.auth)
    assert response.status_code == 400 and response.json()["error"]["type"], response.text[:300]


def test_poison_requests_amid_streams_harm_no_one(deployment: DynProcess) -> None:
    poison = [
        {"prompt": [4294967296]},
        {"prompt": [2**31 - 1]},
        {"prompt": "x", "seed": -(2**63) - 1},
        {"prompt": "x", "top_k": 2**64},
        {"prompt": "x", "stop_token_ids": [2**40]},
    ]

    def stream() -> str:
        body = {"model": "smollm2", "prompt": "hello", "max_tokens": 200, "stream": True, "ignore_eos": True}
        return httpx.post(f"{deployment.url}/v1/completions", json=body, timeout=60, headers=deployment.auth).text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(stream) for _ in range(4)]
        for extra in poison:
            response = httpx.post(
                f"{deployment.url}/v1/completions",
                json={"model": "smollm2", **extra},
                timeout=30,
                headers=deployment.auth,
            )
            assert response.status_code == 400, response.text[:300]
            assert response.json()["error"]["param"], response.text[:300]
        for future in streams:
            text = future.result()
            assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text[-300:]
    assert _workers(deployment.url) == 2


def test_client_chosen_request_ids_never_collide(deployment: DynProcess) -> None:
    body = {"model": "smollm2", "prompt": "hello", "max_tokens": 3000, "stream": True, "ignore_eos": True}

    def stream() -> httpx.Response:
        return httpx.post(
            f"{deployment.url}/v1/completions",
            json=body,
            headers={**deployment.auth, "x-request-id": "same"},
            timeout=60,
        )

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: stream(), range(2)))
    for answer in answers:
        assert answer.status_code == 200 and answer.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in answer.text, answer.text[-300:]
        assert answer.headers["x-request-id"] == "same"  # echoed back; the id inside is the frontend's own


def test_a_non_utf8_request_id_header_is_not_a_500(deployment: DynProcess) -> None:
    body = {"model": "smollm2", "prompt": "hello", "max_tokens": 4}
    response = httpx.post(
        f"{deployment.url}/v1/completions",
        json=body,
        headers=[*deployment.auth.items(), ("x-request-id", b"\xff\xfe")],
        timeout=30,
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "x-request-id", response.text[:300]
