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
        pytest.param('{"model": "m", ' + MSG + ', "n": 2}', "n", id="n-above-1"),
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
    with pytest.raises(RequestError, match="token ids"):
        parse_completion(b'{"model": "m", "prompt": [1, "a"]}')
