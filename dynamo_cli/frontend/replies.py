"""Writing replies on raw ASGI: OpenAI-shaped errors, a JSON body, an SSE stream raced against the
client's disconnect. Shared by the generation APIs (completions.py, translation.py), the lifecycle and the
LoRA and batch routes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Send

from dynamo_cli.core.waits import INTERRUPTIBLE, Interruptible
from dynamo_cli.errors import DynError, NoWorkers, Overloaded, RequestError, TransportError
from dynamo_cli.frontend.openai import error_body
from dynamo_cli.runtime.supervisor import cancel_and_wait

logger = logging.getLogger(__name__)

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

Write = Callable[[bytes], Awaitable[None]]
"""Sends one piece of a streamed body."""
Headers = list[tuple[bytes, bytes]]


async def reply_json(
    send: Send, make_body: Callable[[], Awaitable[bytes]], headers: Callable[[], Headers], request_id: str
) -> str:
    """Compute the body, then send it with 200 and `headers()` (asked after the body: a migrated request
    names its last worker); an error on the way is sent as OpenAI's error instead. Returns the request's
    status for the metrics: success or error."""
    try:
        body = await make_body()
    except DynError as exc:
        await send_error(send, exc)
        return "error"
    except Exception as exc:
        await send_error(send, internal(exc, f"request {request_id}"))
        return "error"
    await send({"type": "http.response.start", "status": 200, "headers": [*JSON_HEADERS, *headers()]})
    await send({"type": "http.response.body", "body": body})
    return "success"


async def stream_sse(
    send: Send,
    receive: Receive,
    headers: Headers,
    produce: Callable[[Write], Awaitable[bytes]],
    abort: Callable[[], None],
    error_event: Callable[[DynError], bytes],
    request_id: str,
    *,
    done: bytes,
) -> str:
    """Start an SSE response, let `produce` write its events (returning its last ones), and end with those
    and `done`; an error becomes `error_event(exc)` and the stream still ends cleanly. The client leaving
    calls `abort`. Returns the status for the metrics: success, cancelled or error."""
    await send({"type": "http.response.start", "status": 200, "headers": [*SSE_HEADERS, *headers]})
    gone: list[bool] = []

    def on_disconnect() -> None:
        gone.append(True)
        abort()

    async def write(data: bytes) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": True})

    status = "success"
    async with watching(receive, on_disconnect):
        try:
            tail = await produce(write)
        except DynError as exc:
            status, tail = "error", error_event(exc)
        except Exception as exc:
            status, tail = "error", error_event(internal(exc, f"streaming request {request_id}"))
    if gone:
        status, tail = "cancelled", b""
    await send({"type": "http.response.body", "body": tail + done, "more_body": False})
    return status


def internal(exc: Exception, doing: str) -> DynError:
    """Log an unexpected failure with an id, and return the error the client sees (no internals)."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("internal error %s while %s", error_id, doing, exc_info=exc)
    return DynError(f"internal error while {doing} (error id {error_id} in the frontend's log)")


T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected."""


async def unless_gone(prepare: Callable[[], Coroutine[Any, Any, T]], receive: Receive) -> tuple[T, bool]:
    """Run `prepare()` in this task, its interruptible waits ended when the client leaves (ClientGone); its result,
    and whether the client left after all (the caller then closes what was prepared).

    NOTE: no task is made for it and the client is watched only once a wait begins (`Interruptible(on_wait)`): a
    request that waits for nothing goes from its tokens to its worker without yielding the event loop, where a burst
    of arrivals would put it behind every other arrival's parsing and tokenizing at each turn. The watcher, when one
    was started, is cancelled and awaited before this returns; `guard.task` is cleared so the guard holds nothing
    after the wait (a reference cycle kept the whole prepared request alive until a garbage-collection pass)."""
    watcher: asyncio.Task[None] | None = None

    def watch() -> None:
        nonlocal watcher
        if watcher is None:
            watcher = asyncio.get_running_loop().create_task(watch_disconnect(receive, guard.interrupt))

    guard = Interruptible(on_wait=watch)
    guard.task = task = asyncio.current_task()
    token = INTERRUPTIBLE.set(guard)
    try:
        return await prepare(), guard.is_gone
    except asyncio.CancelledError:
        if guard.has_cancelled and task is not None:
            task.uncancel()  # our own interrupt's
        if guard.is_gone and (task is None or task.cancelling() == 0):  # the client left, not a shutdown
            raise ClientGone() from None
        raise
    finally:
        INTERRUPTIBLE.reset(token)
        guard.task = None
        await cancel_and_wait(watcher)


@contextlib.asynccontextmanager
async def watching(receive: Receive, on_disconnect: Callable[[], None]) -> AsyncIterator[None]:
    """`on_disconnect()` is called if the client leaves while the block runs; the watcher ends with the block."""
    watcher = asyncio.get_running_loop().create_task(watch_disconnect(receive, on_disconnect))
    try:
        yield
    finally:
        await cancel_and_wait(watcher)


async def watch_disconnect(receive: Receive, on_disconnect: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    on_disconnect()


def error_type(exc: DynError) -> str:
    if isinstance(exc, RequestError):
        return exc.error_type
    if isinstance(exc, NoWorkers | Overloaded):
        return "service_unavailable"
    return "internal_error"


async def send_error(send: Send, exc: DynError) -> None:
    status, headers, body = error_reply(exc)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def error_reply(exc: DynError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The status, headers and OpenAI-shaped body of the response for `exc`."""
    status = exc.status  # from its class (an instance may say more: a remote worker's, a body too large)
    if isinstance(exc, RequestError):
        param, code = exc.param, exc.code
    elif isinstance(exc, NoWorkers | Overloaded):
        param, code = None, "service_unavailable"
    elif isinstance(exc, TransportError):
        param, code = None, exc.code
    else:
        param, code = None, "internal_error"
    body = error_body(str(exc), error_type(exc), param, code)
    retry_after = max(1, math.ceil(exc.retry_after or 1))
    headers = [*JSON_HEADERS, (b"retry-after", str(retry_after).encode())] if status in (429, 503) else JSON_HEADERS
    headers = [*JSON_HEADERS, (b"www-authenticate", b"Bearer")] if status == 401 else headers
    return status, headers, body


def error_response(exc: DynError) -> Response:
    """`error_reply(exc)` as a Starlette response, for the routes off the raw ASGI path (LoRA, batches)."""
    status, headers, body = error_reply(exc)
    return Response(body, status_code=status, headers={k.decode(): v.decode() for k, v in headers})
