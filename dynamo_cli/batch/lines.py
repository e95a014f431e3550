"""An input file's lines checked up front, each with the validator its endpoint's HTTP edge uses.

A line is `{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body": {...}}`. A line
that is not such an object, names another endpoint than its batch's, repeats a `custom_id`, or whose body
the endpoint would refuse, is not run: it goes to the error file with the 400 the endpoint would have
given (the same message and `param`), and the batch goes on without it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from dynamo_cli.batch.store import Line, Result
from dynamo_cli.errors import RequestError
from dynamo_cli.frontend.embeddings import parse_embeddings
from dynamo_cli.frontend.openai import error_body, parse_chat, parse_completion

ENDPOINTS: dict[str, Callable[[bytes], Any]] = {
    "/v1/chat/completions": parse_chat,
    "/v1/completions": parse_completion,
    "/v1/embeddings": parse_embeddings,
}
"""The endpoints a batch may run, and the validator of each one's body."""

MAX_CUSTOM_ID = 512
"""Characters of a `custom_id` (OpenAI's limit)."""


def check_lines(endpoint: str, raw_lines: Iterable[bytes]) -> tuple[list[Line], list[tuple[int, str | None, Result]]]:
    """The valid lines, and each invalid one as (line number, its custom_id if it has one, its 400)."""
    valid: list[Line] = []
    invalid: list[tuple[int, str | None, Result]] = []
    seen: set[str] = set()
    for line_no, raw in enumerate(raw_lines):
        custom_id: str | None = None
        try:
            item = _object(raw)
            custom_id = _custom_id(item, seen)
            valid.append(Line(line_no, custom_id, _body(item, endpoint)))
        except RequestError as exc:
            invalid.append((line_no, custom_id, refusal(exc)))
    return valid, invalid


def refusal(exc: RequestError) -> Result:
    """The result of a line refused with `exc`: the status and body the endpoint would have replied."""
    body = json.loads(error_body(str(exc), exc.error_type, exc.param, exc.code))
    return Result(exc.status, body)


def _object(raw: bytes) -> dict[str, Any]:
    try:
        item = json.loads(raw)
    except (ValueError, RecursionError):
        raise RequestError("the line is not JSON", param="line") from None
    if not isinstance(item, dict):
        raise RequestError("the line must be a JSON object with custom_id, method, url and body", param="line")
    return item


def _custom_id(item: dict[str, Any], seen: set[str]) -> str:
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        raise RequestError(f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters", param="custom_id")
    if custom_id in seen:
        raise RequestError(f"custom_id {custom_id!r} appears on an earlier line", param="custom_id")
    seen.add(custom_id)
    return custom_id


def _body(item: dict[str, Any], endpoint: str) -> bytes:
    """The line's request body as JSON, once its endpoint's edge would take it."""
    if item.get("method", "POST") != "POST":
        raise RequestError("method must be POST", param="method")
    if item.get("url") != endpoint:
        raise RequestError(f"url must be the batch's endpoint, {endpoint}", param="url")
    body = item.get("body")
    if not isinstance(body, dict):
        raise RequestError("body must be a JSON object", param="body")
    if body.get("stream"):
        raise RequestError("a batch request cannot stream", param="body.stream")
    raw = json.dumps(body).encode()
    ENDPOINTS[endpoint](raw)
    return raw
