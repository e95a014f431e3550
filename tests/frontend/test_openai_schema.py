"""Edge validation of OpenAI requests: every rejection names the field."""

from __future__ import annotations

import pytest

from dynamo_cli.errors import RequestError
from dynamo_cli.frontend.openai import parse_chat, parse_completion

MSG = '"messages": [{"role": "user", "content": "x"}]'


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param('{"model": "m", ' + MSG + ', "max_tokens": 0}', "max_tokens", id="zero-max-tokens"),
        pytest.param('{"model": "m", ' + MSG + ', "top_p": 1.5}', "top_p", id="top-p"),
        pytest.param('{"model": "m", ' + MSG + ', "n": 129}', "n", id="n-above-128"),
        pytest.param('{"model": "m", ' + MSG + ', "frobnicate": []}', "frobnicate", id="unknown-field"),
        pytest.param('{"model": "m", ' + MSG + ', "stop": [""]}', "stop", id="empty-stop"),
        pytest.param('{"model": "m", "messages": []}', "messages", id="no-messages"),
        pytest.param(
            '{"model": "m", "messages": [{"role": "robot", "content": "x"}]}', "messages[0].role", id="bad-role"
        ),
        pytest.param('{"model": 3, ' + MSG + "}", "model", id="model-not-string"),
    ],
)
def test_invalid_chat_requests_name_the_field(body: str, param: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_chat(body.encode())
    assert info.value.param == param and info.value.status == 400


def test_completion_prompt_may_be_token_ids_but_not_mixed() -> None:
    assert parse_completion(b'{"model": "m", "prompt": [1, 2, 3]}').prompt == [1, 2, 3]
    assert parse_completion(b'{"model": "m", "prompt": [0, 2147483647]}').prompt == [0, 2**31 - 1]
    with pytest.raises(RequestError, match="token ids"):
        parse_completion(b'{"model": "m", "prompt": [1, "a"]}')


@pytest.mark.parametrize("item", [b"true", b"2.5", b"null", b"[1]", b"{}"])
def test_a_prompt_item_that_is_no_token_id_is_named(item: bytes) -> None:
    with pytest.raises(RequestError) as info:
        parse_completion(b'{"model": "m", "prompt": [1, ' + item + b"]}")
    assert info.value.param == "prompt[1]" and info.value.status == 400


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param(b'{"model": "m", "prompt": [4294967296]}', "prompt", id="token-id-2^32"),
        pytest.param(b'{"model": "m", "prompt": [1, -1]}', "prompt", id="negative-token-id"),
        pytest.param(b'{"model": "m", "prompt": "x", "seed": -9223372036854775809}', "seed", id="seed-below-int64"),
        pytest.param(b'{"model": "m", "prompt": "x", "seed": 9223372036854775808}', "seed", id="seed-above-int64"),
        pytest.param(b'{"model": "m", "prompt": "x", "top_k": 18446744073709551616}', "top_k", id="top-k-2^64"),
        pytest.param(b'{"model": "m", "prompt": "x", "min_tokens": 2147483648}', "min_tokens", id="min-tokens"),
        pytest.param(b'{"model": "m", "prompt": "x", "max_tokens": 1e400}', "max_tokens", id="max-tokens-inf"),
        pytest.param(
            b'{"model": "m", "prompt": "x", "stop_token_ids": [18446744073709551616]}',
            "stop_token_ids[0]",
            id="stop-token-id-2^64",
        ),
    ],
)
def test_integers_beyond_what_an_engine_takes_are_400s_naming_the_field(body: bytes, param: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_completion(body)
    assert info.value.param == param and info.value.status == 400


@pytest.mark.parametrize("depth", [33, 1_000, 100_000])
@pytest.mark.parametrize("field", ["logprobs", "unknown_field"])
def test_deep_json_is_refused_before_parsing(depth: int, field: str) -> None:
    body = b'{"model": "m", "prompt": "x", "' + field.encode() + b'": ' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(RequestError, match="nested deeper than 32") as info:
        parse_completion(body)
    assert info.value.status == 400


def test_brackets_inside_strings_do_not_count_as_depth() -> None:
    prompt = '"' + "[{" * 500 + '\\" ]]' + '"'
    assert parse_completion(b'{"model": "m", "prompt": ' + prompt.encode() + b"}").prompt.startswith("[{")


def test_invalid_utf8_is_a_400() -> None:
    with pytest.raises(RequestError, match="UTF-8") as info:
        parse_completion(b'{"model": "m", "prompt": "\xff\xfe"}')
    assert info.value.status == 400
