"""Generation.text over a dispatch's stream (the core's seam: batches and their token ids) with the built-in model's
tokenizer: where a remote prefill's first token goes (`--disagg-first-token`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

import pytest

from dynamo_cli.config.routing import DisaggConfig
from dynamo_cli.errors import ConfigError
from dynamo_cli.frontend.pipeline import Generation
from dynamo_cli.model.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer("smollm2")


def _ids(text: str) -> list[int]:
    return asyncio.run(TOKENIZER.encode_async(text))


class _Dispatch:
    """The remote prefill's token first (no batch), then the decode worker's batches, one token each."""

    def __init__(self, first: list[int], rest: list[list[int]], first_token: str) -> None:
        self.rules = SimpleNamespace(disagg=DisaggConfig(first_token=first_token))
        self.output = SimpleNamespace(finish_reason=None, token_ids=[])
        self._first, self._rest = first, rest

    async def stream(self) -> AsyncGenerator[tuple[list[Any], list[int]], None]:
        yield [], self._first
        for ids in self._rest:
            yield [b"chunk"], ids
        self.output.finish_reason = "length"


async def _pieces(first: list[int], rest: list[list[int]], first_token: str) -> list[str]:
    gen = Generation(_Dispatch(first, rest, first_token), TOKENIZER)  # type: ignore[arg-type]
    return [piece async for piece in gen.text()]


@pytest.mark.parametrize("first_token", ["early", "with-decode"])
def test_the_prefill_token_goes_alone_or_with_the_decode_workers_first(first_token: str) -> None:
    one, two, three = (_ids(w) for w in (" Paris", " is", " lovely"))
    pieces = asyncio.run(_pieces(one, [two, three], first_token))
    assert "".join(pieces) == " Paris is lovely"
    if first_token == "early":
        assert pieces[0] == " Paris"
    else:
        assert pieces[0] == " Paris is"


def test_a_held_token_still_ends_a_one_token_answer() -> None:
    pieces = asyncio.run(_pieces(_ids(" Paris"), [], "with-decode"))
    assert "".join(pieces) == " Paris"


def test_an_unknown_first_token_mode_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="--disagg-first-token"):
        DisaggConfig(first_token="later")
