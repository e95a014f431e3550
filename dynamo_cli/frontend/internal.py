"""A request the frontend makes to itself, in process: the batch runner's lines (batch/runner.py).

It goes through the same path as an HTTP request (validation, routing, the router queue, metrics), without a
socket and without the API-key gate (its batch was created by a client the gate let in). Its scope carries
`INTERNAL_DEADLINE`, which an HTTP request cannot set: the request then gets `INTERNAL_PRIORITY`, below any
`x-dyn-priority` a client may send, and that deadline.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.types import ASGIApp, Message

from dynamo_cli.core.queue import LOWEST_CLIENT_PRIORITY

INTERNAL_DEADLINE = "dyn.internal_deadline"
"""Scope key: the `time.monotonic()` by which the request must have started (the batch's window)."""
INTERNAL_PRIORITY = LOWEST_CLIENT_PRIORITY - 1
"""Below any client's `x-dyn-priority`: background work to the router (core/queue.py)."""


async def call(app: ASGIApp, path: str, body: bytes, seconds_left: float) -> tuple[int, bytes]:
    """POST `body` to `path` on `app`; the response's status and whole body (a non-streamed request)."""
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 0),
        "server": ("dyn-internal", 0),
        INTERNAL_DEADLINE: time.monotonic() + seconds_left,
    }
    sent = False
    never = asyncio.Event()
    status, chunks = 500, []

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()  # the caller never leaves: it is cancelled instead
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
        elif message["type"] == "http.response.body":
            chunks.append(bytes(message.get("body", b"")))

    await app(scope, receive, send)
    return status, b"".join(chunks)
