"""A lean HTTP/1.1 streaming client: keep-alive connections, chunked framing and SSE parsed by hand.

Usage (also the client that `benchmarks/overhead.py` reuses):

    async with HttpClient("http://127.0.0.1:8000", max_connections=32) as client:
        record = await client.stream_chat({"model": "m", "messages": [...], "max_tokens": 64})
        record.ttft, record.text, record.completion_tokens, record.error

`stream_*` never raise for a failed request: the record carries `error` (and `status`), so a benchmark
counts failures instead of crashing. `get_json` raises `EndpointUnreachable`/`EndpointError`.

NOTE: each connection is an `asyncio.Protocol` whose `data_received` stamps every SSE `data:` event with
`time.perf_counter()` as the bytes arrive and undoes the framing in place (`bench/sse.py`); the awaiting
coroutine wakes once per request, when the response ends, and only then decodes all the JSON events in one
msgspec call. No per-chunk task wake-ups, no per-read timeouts (one timer per request watches idleness),
so the CPU per request is a few event-loop callbacks plus a few microseconds per chunk.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import msgspec

from dynamo_cli.bench.sse import Response
from dynamo_cli.errors import DynError

__all__ = ["EndpointError", "EndpointUnreachable", "Headers", "HttpClient", "RequestRecord"]


class EndpointUnreachable(DynError):
    """No TCP connection could be made to the benchmarked URL."""

    def __init__(self, url: str, cause: str) -> None:
        self.url = url
        self.cause = cause
        super().__init__(f"cannot reach {url}: {cause}; is the server running, and is --url right?")


class EndpointError(DynError):
    """The endpoint answered, but not with what a streaming OpenAI server sends."""


# ---------------------------------------------------------------------------------------------- records


@dataclass(slots=True)
class RequestRecord:
    """One request's timeline and outcome. Times are `time.perf_counter()` seconds."""

    start: float = 0.0
    """When the request bytes were handed to the socket."""
    end: float = 0.0
    """When the response ended (the last byte of the stream), or when it failed."""
    status: int = 0
    """HTTP status; 0 when no response head arrived."""
    first_event: float | None = None
    """Arrival of the first SSE event of any kind (for example vLLM's role-only chunk)."""
    chunk_times: list[float] = field(default_factory=list)
    """Arrival time of every event that carried non-empty content (text or reasoning)."""
    pieces: list[str] = field(default_factory=list)
    """The content of each of those events, in order."""
    prompt_tokens: int | None = None
    """`usage.prompt_tokens`, when the server sent usage."""
    completion_tokens: int | None = None
    """`usage.completion_tokens`, when the server sent usage."""
    cached_tokens: int | None = None
    """`usage.prompt_tokens_details.cached_tokens`: prompt tokens the server found cached, when it said."""
    retry_after: float | None = None
    """The `Retry-After` of a 429 or 503 answer, in seconds (None: not given, or given as a date)."""
    error: str | None = None
    """Why the request failed; None for a success."""
    input_tokens: int = 0
    """Prompt length the workload asked for (set by the caller)."""
    scheduled: float | None = None
    """When the load generator meant to send it (rate and trace modes; set by the caller)."""
    turn: int = 0
    """Its index among its conversation's requests, from 0 (an agent session's call; set by the caller)."""
    tenant: str | None = None
    """The tenant that sent it (multi-tenant runs; set by the caller)."""

    @property
    def is_ok(self) -> bool:
        return self.error is None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def ttft(self) -> float | None:
        """Seconds from send to the first non-empty content event."""
        return self.chunk_times[0] - self.start if self.chunk_times else None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _PromptDetails | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: Any = None


Headers = Sequence[tuple[str, str]]
"""Header (name, value) pairs of one request."""

_CHUNK_DECODER = msgspec.json.Decoder(_Chunk)
_STREAM_DECODER = msgspec.json.Decoder(list[_Chunk])


def _chunk_content(chunk: _Chunk) -> str:
    parts: list[str] = []
    for choice in chunk.choices:
        if choice.text:
            parts.append(choice.text)
        delta = choice.delta
        if delta is not None:
            for piece in (delta.reasoning_content, delta.reasoning, delta.content):
                if piece:
                    parts.append(piece)
    return parts[0] if len(parts) == 1 else "".join(parts)


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def fill_from_events(record: RequestRecord, events: list[tuple[float, bytes]]) -> None:
    """Decode SSE `data:` payloads into the record's content timeline, usage and error."""
    chunks = None
    try:  # one decode call for the whole stream; per event only to find a malformed one
        chunks = _STREAM_DECODER.decode(b"[" + b",".join([p for _, p in events]) + b"]")
    except msgspec.DecodeError:
        pass
    if chunks is None or len(chunks) != len(events):
        chunks = []
        for _, payload in events:
            try:
                chunks.append(_CHUNK_DECODER.decode(payload))
            except msgspec.DecodeError:
                record.error = f"malformed SSE event: {payload[:120]!r}"
                return
    times, pieces = record.chunk_times, record.pieces
    for (arrival, _), chunk in zip(events, chunks, strict=True):
        choices = chunk.choices
        if len(choices) == 1:  # the common shape first: one choice, plain content, no usage
            delta = choices[0].delta
            content = delta.content if delta is not None else choices[0].text
            if content and chunk.usage is None:
                times.append(arrival)
                pieces.append(content)
                continue
        if chunk.error is not None:
            record.error = f"server error in stream: {_error_text(chunk.error)}"
            return
        if (usage := chunk.usage) is not None:
            record.prompt_tokens = usage.prompt_tokens
            record.completion_tokens = usage.completion_tokens
            if usage.prompt_tokens_details is not None:
                record.cached_tokens = usage.prompt_tokens_details.cached_tokens
        content = _chunk_content(chunk)
        if content:
            times.append(arrival)
            pieces.append(content)


# ---------------------------------------------------------------------------------------------- connection


class _Connection(asyncio.Protocol):
    """One keep-alive connection; runs one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.is_closed = False
        self.has_response_bytes = False
        self.last_activity = 0.0
        self._response: Response | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._failure: str | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self.last_activity = now
        response = self._response
        if response is None:
            return  # bytes outside a request: the connection is unusable; the next send notices
        self.has_response_bytes = True
        try:
            response.feed(data, now)
        except ValueError as exc:
            self._finish(f"bad HTTP response: {exc}")
            return
        if response.is_done:
            self._finish(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        response = self._response
        if response is not None and self._failure is None:
            response.close(time.perf_counter())
            self._finish(None if response.is_done else "connection closed by the server mid-response")

    def fail(self, failure: str) -> None:
        """End the current request with `failure` (a timeout); the connection is not reused."""
        self.close()
        self._finish(failure)

    def _finish(self, failure: str | None) -> None:
        self._failure = failure
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def start(self, request: bytes) -> asyncio.Future[None]:
        assert self.transport is not None
        self._response = Response()
        self._failure = None
        self.has_response_bytes = False
        self._waiter = asyncio.get_running_loop().create_future()
        self.last_activity = time.perf_counter()
        self.transport.write(request)
        return self._waiter

    def take(self) -> tuple[Response, str | None]:
        response, self._response = self._response, None
        assert response is not None
        return response, self._failure

    def close(self) -> None:
        self.is_closed = True
        if self.transport is not None:
            self.transport.close()


# ------------------------------------------------------------------------------------------------ client


class HttpClient:
    """A pool of at most `max_connections` keep-alive HTTP/1.1 connections to one server.

    Every wait is bounded: `connect_timeout` for the TCP connect, `idle_timeout` between two reads of one
    response, and `request_timeout` for a whole request.
    """

    def __init__(
        self,
        url: str,
        *,
        max_connections: int = 1,
        connect_timeout: float = 10.0,
        idle_timeout: float = 120.0,
        request_timeout: float = 600.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise EndpointError(f"--url must look like http://host:port, got {url!r} (https is not supported)")
        self.url = url
        self.host = parts.hostname
        self.port = parts.port or 80
        self.base_path = parts.path.rstrip("/")
        if self.base_path.endswith("/v1"):
            self.base_path = self.base_path[:-3]
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.request_timeout = request_timeout
        self._headers = {k.lower(): v for k, v in (headers or {}).items()}
        self._head_suffix = _head_lines(self.host, self.port, self._headers)
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: deque[_Connection] = deque()
        self._encoder = msgspec.json.Encoder()

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every idle connection (idempotent)."""
        while self._idle:
            self._idle.pop().close()

    ##### Public API #####

    async def stream_chat(self, body: dict[str, Any]) -> RequestRecord:
        """POST a streaming request to /v1/chat/completions; returns its record, never raises for it."""
        return await self.stream("/v1/chat/completions", body)

    async def stream_completion(self, body: dict[str, Any]) -> RequestRecord:
        """POST a streaming request to /v1/completions; returns its record, never raises for it."""
        return await self.stream("/v1/completions", body)

    async def stream(
        self,
        path: str,
        body: dict[str, Any] | bytes,
        record: RequestRecord | None = None,
        headers: Headers = (),
    ) -> RequestRecord:
        """POST `body` (a dict gets `stream: true` added) and read the SSE answer into a record; `headers` are
        this request's own (one named like a client header replaces it: a tenant's own key)."""
        if isinstance(body, dict):
            body = self._encoder.encode({**body, "stream": True})
        record = record if record is not None else RequestRecord()
        request = self._request_bytes("POST", path, body, headers)
        await self._slots.acquire()
        try:
            await self._send(request, record)
        finally:
            self._slots.release()
        return record

    async def get_json(self, path: str, headers: Headers = ()) -> Any:
        """GET a JSON document; raises EndpointUnreachable or EndpointError."""
        record = RequestRecord()
        async with self._slots:
            response = await self._send(self._request_bytes("GET", path, b"", headers), record)
        if response is None:
            raise EndpointUnreachable(self.url, record.error or "no response")
        if response.status != 200:
            raise EndpointError(f"GET {path} answered HTTP {response.status}: {bytes(response.body[:200])!r}")
        try:
            return msgspec.json.decode(bytes(response.body))
        except msgspec.DecodeError as exc:
            raise EndpointError(f"GET {path} did not return JSON ({exc})") from None

    ##### internals #####

    def _request_bytes(self, method: str, path: str, body: bytes, headers: Headers = ()) -> bytes:
        suffix = self._head_suffix
        if headers:
            suffix = _head_lines(self.host, self.port, {**self._headers, **{k.lower(): v for k, v in headers}})
        head = (
            f"{method} {self.base_path}{path} HTTP/1.1\r\n{suffix}"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        return head.encode("latin-1") + body

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout):
            transport, conn = await loop.create_connection(_Connection, self.host, self.port)
        conn.transport = transport  # uvloop may call connection_made after create_connection returns
        return conn

    async def _send(self, request: bytes, record: RequestRecord) -> Response | None:
        for attempt in range(2):
            reused = bool(self._idle)
            conn = self._idle.pop() if reused else None
            if conn is None or conn.is_closed:
                try:
                    conn = await self._connect()
                except (OSError, TimeoutError) as exc:
                    record.start = record.end = time.perf_counter()
                    record.error = f"cannot connect to {self.host}:{self.port}: {str(exc) or 'timed out'}"
                    return None
            record.start = time.perf_counter()
            response, failure = await self._exchange(conn, request)
            record.end = time.perf_counter()
            if failure and reused and not conn.has_response_bytes and attempt == 0:
                conn.close()  # a stale keep-alive connection the server had closed: retry once on a new one
                continue
            self._settle(conn, response, failure)
            self._fill(record, response, failure)
            return response
        return None  # unreachable: the second attempt always returns

    async def _exchange(self, conn: _Connection, request: bytes) -> tuple[Response, str | None]:
        waiter = conn.start(request)
        # one timer per request, re-armed only when it fires early: cheaper than a timeout per read
        conn.timer = asyncio.get_running_loop().call_later(
            min(self.idle_timeout, self.request_timeout), self._watch, conn, conn.last_activity
        )
        try:
            await waiter
        except BaseException:
            conn.take()
            conn.close()
            raise
        finally:
            if conn.timer is not None:
                conn.timer.cancel()
        return conn.take()

    def _watch(self, conn: _Connection, started: float) -> None:
        now = time.perf_counter()
        total_left = self.request_timeout - (now - started)
        idle_left = self.idle_timeout - (now - conn.last_activity)
        if total_left <= 0:
            conn.fail(f"request timed out after {self.request_timeout:g} s")
        elif idle_left <= 0:
            conn.fail(f"no bytes for {self.idle_timeout:g} s (idle timeout)")
        else:
            loop = asyncio.get_running_loop()
            conn.timer = loop.call_later(min(idle_left, total_left), self._watch, conn, started)

    def _settle(self, conn: _Connection, response: Response, failure: str | None) -> None:
        if failure is None and response.is_done and response.keep_alive and not conn.is_closed:
            self._idle.append(conn)
        else:
            conn.close()

    def _fill(self, record: RequestRecord, response: Response, failure: str | None) -> None:
        record.status = response.status
        if response.events:
            record.first_event = response.events[0][0]
            fill_from_events(record, response.events)
        if failure is not None:
            record.error = failure
        elif response.status != 200:
            record.error = f"HTTP {response.status}: {_body_message(response.body)}"
            if response.status in (429, 503):
                record.retry_after = _seconds(response.headers.get("retry-after"))
        elif not response.is_sse:
            record.error = f"not an SSE stream (content-type {response.headers.get('content-type', 'missing')!r})"
        elif response.is_sse and not response.events and not response.saw_done:
            record.error = "the SSE stream carried no data events"


def _head_lines(host: str, port: int, headers: dict[str, str]) -> str:
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise EndpointError(f"header {name!r} has a line break in its name or value")
    return f"Host: {host}:{port}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())


def _seconds(value: str | None) -> float | None:
    """A `Retry-After` in seconds; None for none, or for an HTTP date (servers of this field send seconds)."""
    try:
        seconds = float(value) if value is not None else math.nan
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _body_message(body: bytearray) -> str:
    try:
        doc = msgspec.json.decode(bytes(body))
    except msgspec.DecodeError:
        return bytes(body[:200]).decode("utf-8", "replace").strip() or "empty body"
    if isinstance(doc, dict) and "error" in doc:
        return _error_text(doc["error"])
    if isinstance(doc, dict) and "detail" in doc:
        return str(doc["detail"])
    return str(doc)[:200]
