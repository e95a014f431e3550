"""The request plane's client side: one connection to one `RequestServer` (transport.py), streams opened on it.

A stream that buffers more than `STREAM_BUFFER` items pauses reading on the whole connection until its consumer
catches up. Given the cluster secret, a client sends no request before the server proved it holds it
(handshake.py).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import msgspec

from dynamo_cli.errors import (
    AuthenticationFailed,
    BackendUnavailable,
    RemoteError,
    StreamTimeout,
    TransportError,
    WorkerDisconnected,
)
from dynamo_cli.runtime.framing import Cancel, Data, End, Fail, FrameCodec, FrameError, Open
from dynamo_cli.runtime.handshake import HANDSHAKE_TIMEOUT_S, MAGIC, ClientHandshake, HandshakeError
from dynamo_cli.runtime.transport import CONNECT_TIMEOUT_S, STREAM_BUFFER, STREAM_IDLE_TIMEOUT_S, FrameWriter, Spec

Req = TypeVar("Req")
Rep = TypeVar("Rep")


class ResponseStream:
    """One open stream; iterate `batches()` or `async for` bodies; `cancel()` aborts it remotely."""

    __slots__ = ("_client", "_done", "_error", "_items", "_loop", "_waiter", "sid")

    def __init__(self, client: RequestClient, sid: int) -> None:
        self._client = client
        self._loop = client._loop
        self.sid = sid
        self._items: deque[msgspec.Raw] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._done = False
        self._error: TransportError | None = None

    def _push(self, body: msgspec.Raw) -> None:
        self._items.append(body)
        if len(self._items) == STREAM_BUFFER:
            self._client._throttle(self, True)
        self._wake()

    def _finish(self, error: TransportError | None) -> None:
        self._done = True
        self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _expire(self, timeout: float | None) -> None:
        if self._waiter is not None and not self._waiter.done():
            seconds = timeout or self._client.idle_timeout
            self._waiter.set_exception(StreamTimeout(f"no response within {seconds:.0f} s"))

    async def next_batch(self, timeout: float | None = None) -> list[msgspec.Raw]:
        """Every body received so far (at least one); [] when the stream ended cleanly. StreamTimeout after
        `timeout` s (default: the client's idle timeout) with nothing received; the stream stays usable."""
        while not self._items:
            if self._done:
                if self._error is not None:
                    raise self._error
                return []
            self._waiter = self._loop.create_future()
            timer = self._loop.call_later(timeout or self._client.idle_timeout, self._expire, timeout)
            try:
                await self._waiter
            finally:
                timer.cancel()
                self._waiter = None
        items = list(self._items)
        self._items.clear()
        if len(items) >= STREAM_BUFFER:
            self._client._throttle(self, False)
        return items

    async def __aiter__(self) -> AsyncIterator[msgspec.Raw]:
        while batch := await self.next_batch():
            for item in batch:
                yield item

    def cancel(self) -> None:
        """Abort the stream on the server (frees its work) and stop delivering. Idempotent."""
        if not self._done:
            self._client._cancel(self)
            self._finish(None)


class _ClientConnection(asyncio.Protocol):
    def __init__(self, client: RequestClient, handshake: ClientHandshake | None) -> None:
        self._client = client
        self._codec = FrameCodec()
        self._handshake = handshake
        """Set until the server proved it holds the secret; nothing is sent meanwhile."""
        self._transport: asyncio.Transport | None = None
        self.ready: asyncio.Future[None] = client._loop.create_future()
        """Done once the server is proven (at once without a secret); AuthenticationFailed if it is not."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._handshake is None:
            self.ready.set_result(None)

    def _authenticate(self, handshake: ClientHandshake, data: bytes) -> bytes:
        """Feed the handshake (answering the hello); once the server is proven, the bytes after it."""
        assert self._transport is not None
        try:
            reply, rest = handshake.feed(data)
        except HandshakeError as exc:
            self._fail_handshake(str(exc))
            return b""
        if reply:
            self._transport.write(reply)
        if handshake.done:
            self._handshake = None
            self.ready.set_result(None)
        return rest

    def _fail_handshake(self, reason: str) -> None:
        if not self.ready.done():
            self.ready.set_exception(AuthenticationFailed(self._client.address, reason))
        if self._transport is not None:
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._handshake is not None:
            data = self._authenticate(self._handshake, data)
            if not data:
                return
        try:
            frames = self._codec.feed(data)
        except FrameError as exc:
            hint = "; it asks for a cluster secret, and this process has none" if MAGIC in data[:32] else ""
            self._client._lost(WorkerDisconnected(f"bad frame from {self._client.address}: {exc}{hint}"))
            return
        streams = self._client._streams
        for frame in frames:
            stream = streams.get(frame.sid)
            if stream is None:
                continue  # cancelled locally; late frames are dropped
            if type(frame) is Data:
                stream._push(frame.body)
            elif type(frame) is End:
                del streams[frame.sid]
                stream._finish(None)
            elif type(frame) is Fail:
                del streams[frame.sid]
                stream._finish(_remote_error(frame))

    def pause_writing(self) -> None:
        self._client._writer.pause()

    def resume_writing(self) -> None:
        self._client._writer.resume()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._handshake is not None:  # never authenticated: no stream of the client's was on it
            self._fail_handshake("it closed the connection during the handshake (it holds another secret?)")
            return
        self._client._lost(WorkerDisconnected(f"connection to {self._client.address} lost: {exc or 'closed'}"))


def _remote_error(frame: Fail) -> TransportError:
    if frame.is_migratable:
        if frame.code == BackendUnavailable.__name__:
            return BackendUnavailable(frame.message)
        return WorkerDisconnected(f"{frame.code}: {frame.message}")
    return RemoteError(frame.message, frame.code, frame.status, frame.retry_after)


class RequestClient:
    """One connection to one `RequestServer`, opened lazily, reopened after a loss.

    With `secret`, each connection first runs the handshake: a server that cannot prove it holds the
    secret gets no request (AuthenticationFailed, which callers may retry elsewhere).
    """

    def __init__(
        self, address: str, *, idle_timeout: float = STREAM_IDLE_TIMEOUT_S, secret: bytes | None = None
    ) -> None:
        self.address = address
        self.idle_timeout = idle_timeout
        self._secret = secret
        self._loop = asyncio.get_running_loop()
        self._writer = FrameWriter(self._loop)
        self._streams: dict[int, ResponseStream] = {}
        self._ids = itertools.count(1)
        self._connecting: asyncio.Lock = asyncio.Lock()
        self._throttled: set[int] = set()
        self._closed = False

    @property
    def is_connected(self) -> bool:
        """Connected (and authenticated): a stream opens without a wait."""
        return self._writer.transport is not None and not self._writer.transport.is_closing()

    @property
    def num_streams(self) -> int:
        """Streams open on this connection."""
        return len(self._streams)

    async def open(self, spec: Spec[Req, Any], request: Req, *, name: str | None = None) -> ResponseStream:
        """Start a stream of `spec`'s replies to `request` (under `name` where the deployment names the endpoint);
        each item is `spec.decode_reply`'s to read. WorkerDisconnected if the server cannot be reached."""
        return await self.open_stream(name or spec.name, spec.encode(request))

    async def call(self, spec: Spec[Req, Rep], request: Req, *, name: str | None = None) -> Rep:
        """`spec`'s one reply to `request`; RemoteError if the stream ends with none. The stream is closed after."""
        stream = await self.open(spec, request, name=name)
        try:
            batch = await stream.next_batch()
        finally:
            stream.cancel()  # a no-op once it ended
        if not batch:
            raise RemoteError(f"{self.address} sent no {spec.name} reply", status=502)
        return spec.decode_reply(batch[0])

    async def open_stream(self, endpoint: str, body: bytes) -> ResponseStream:
        """Start a stream with an encoded body (`open` encodes it); raise WorkerDisconnected if the server cannot be
        reached."""
        if self._writer.transport is None or self._writer.transport.is_closing():
            await self._connect()
        stream = ResponseStream(self, next(self._ids))
        self._streams[stream.sid] = stream
        self._writer.send_now(Open(stream.sid, endpoint, msgspec.Raw(body)))
        return stream

    async def _connect(self) -> None:
        async with self._connecting:
            if self._writer.transport is not None and not self._writer.transport.is_closing():
                return
            host, _, port = self.address.rpartition(":")
            handshake = ClientHandshake(self._secret) if self._secret is not None else None
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    transport, protocol = await self._loop.create_connection(
                        lambda: _ClientConnection(self, handshake), host, int(port)
                    )
            except (OSError, TimeoutError) as exc:
                raise WorkerDisconnected(f"cannot connect to {self.address}: {exc or 'timed out'}") from exc
            await self._authenticated(transport, protocol)
            self._writer = FrameWriter(self._loop)
            self._writer.transport = transport

    async def _authenticated(self, transport: asyncio.Transport, protocol: _ClientConnection) -> None:
        """Wait for the handshake; on any failure the connection is closed having carried nothing."""
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                await protocol.ready
        except TimeoutError:
            transport.abort()
            reason = f"no handshake within {HANDSHAKE_TIMEOUT_S:.0f} s (it may run without a cluster secret)"
            raise AuthenticationFailed(self.address, reason) from None
        except BaseException:
            transport.abort()
            raise

    def _cancel(self, stream: ResponseStream) -> None:
        if self._streams.pop(stream.sid, None) is not None:
            self._writer.send(Cancel(stream.sid))
        self._throttle(stream, False)

    def _throttle(self, stream: ResponseStream, on: bool) -> None:
        transport = self._writer.transport
        before = bool(self._throttled)
        (self._throttled.add if on else self._throttled.discard)(stream.sid)
        if transport is not None and before != bool(self._throttled):
            (transport.pause_reading if self._throttled else transport.resume_reading)()

    def _lost(self, error: TransportError) -> None:
        transport, self._writer.transport = self._writer.transport, None
        if transport is not None:
            transport.close()
        streams, self._streams = self._streams, {}
        self._throttled.clear()
        for stream in streams.values():
            stream._finish(error)

    async def close(self) -> None:
        """Close the connection; open streams fail with WorkerDisconnected. Idempotent."""
        if not self._closed:
            self._closed = True
            self._lost(WorkerDisconnected(f"client for {self.address} closed"))
