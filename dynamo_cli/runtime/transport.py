"""The TCP request plane: many concurrent response streams multiplexed on one connection per peer.

`RequestServer` serves named endpoints: a handler takes a request body and yields response bodies.
`RequestClient` holds one connection to one server and opens streams on it. Writes are coalesced
(one syscall per loop iteration, not per frame). Overflow policy: a server stream waits while the
socket's write buffer is over its high-water mark; a client stream that buffers more than
`STREAM_BUFFER` items pauses reading on the whole connection until its consumer catches up.

Authentication is per connection (handshake.py): given the cluster secret, a server serves no frame
before the caller proved it holds the secret, and a client sends no request before the server proved
it too. After that the frame path is the same as without a secret. Without a secret a server listens
on loopback only (`check_exposure`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import cast

import msgspec

from dynamo_cli.errors import (
    AuthenticationFailed,
    ConfigError,
    DynError,
    RemoteError,
    RequestError,
    StreamTimeout,
    TransportError,
    WorkerDisconnected,
)
from dynamo_cli.runtime.framing import Cancel, Data, End, Fail, Frame, FrameCodec, FrameError, Open
from dynamo_cli.runtime.handshake import (
    HANDSHAKE_TIMEOUT_S,
    MAGIC,
    ClientHandshake,
    HandshakeError,
    ServerHandshake,
    is_loopback,
)
from dynamo_cli.runtime.stats import EndpointStats

logger = logging.getLogger(__name__)

Handler = Callable[[msgspec.Raw], AsyncIterator[bytes]]
"""An endpoint: request body in, encoded response bodies out; cancelled when the caller cancels."""

CONNECT_TIMEOUT_S = 3.0
STREAM_IDLE_TIMEOUT_S = 600.0
STREAM_BUFFER = 1024
MAX_HANDSHAKING = 256
"""Connections allowed to be authenticating at once; more are closed at once (a flood costs little)."""
REFUSAL_LOG_INTERVAL_S = 10.0
"""At most one warning per this many seconds about refused connections (a flood does not flood the log)."""


def check_exposure(host: str, secret: bytes | None, plane: str = "request plane") -> None:
    """ConfigError if a `plane` (request plane, KV transfer plane) on `host` would be reachable from the
    network without a secret."""
    if secret is None and not is_loopback(host):
        raise ConfigError(
            f"--host {host or '(all interfaces)'} exposes the {plane} to the network, but no cluster secret"
            " is set; pass --cluster-secret-file PATH or DYN_CLUSTER_SECRET (the same on every node), or listen"
            " on 127.0.0.1"
        )


class _Writer:
    """Coalesces frames written in one loop iteration into one transport write."""

    __slots__ = ("_codec", "_loop", "_pending", "_resumed", "transport")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._codec = FrameCodec()
        self._pending: list[bytes] = []
        self._resumed: asyncio.Future[None] | None = None
        self.transport: asyncio.Transport | None = None

    def send(self, frame: Frame) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(self._codec.encode(frame))

    def _flush(self) -> None:
        data, self._pending = self._pending, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(data))

    def pause(self) -> None:
        if self._resumed is None:
            self._resumed = self._loop.create_future()

    def resume(self) -> None:
        if self._resumed is not None:
            self._resumed.set_result(None)
            self._resumed = None

    async def drained(self) -> None:
        if self._resumed is not None:
            await asyncio.shield(self._resumed)


##### Server #####


class _ServerConnection(asyncio.Protocol):
    def __init__(self, server: RequestServer) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._codec = FrameCodec()
        self._writer = _Writer(self._loop)
        self._streams: dict[int, asyncio.Task[None]] = {}
        self._handshake: ServerHandshake | None = None
        """Set until the peer proved it holds the secret; no frame is read meanwhile."""
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._writer.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._server._connections.add(self)
        if self._server._secret is not None:
            self._challenge(transport, self._server._secret)  # type: ignore[arg-type]

    def _challenge(self, transport: asyncio.Transport, secret: bytes) -> None:
        self._handshake = ServerHandshake(secret)
        self._server._num_handshaking += 1
        self._deadline = self._loop.call_later(HANDSHAKE_TIMEOUT_S, self._refuse, "no valid answer in time")
        if self._server._num_handshaking > MAX_HANDSHAKING:
            self._refuse(f"over {MAX_HANDSHAKING} connections authenticating at once")
        else:
            transport.write(self._handshake.hello())

    def _authenticate(self, handshake: ServerHandshake, data: bytes) -> bytes:
        """Feed the handshake; once the peer is proven, the bytes after it (frames), else b""."""
        transport = self._writer.transport
        if transport is None or transport.is_closing():
            return b""
        try:
            reply, rest = handshake.feed(data)
        except HandshakeError as exc:
            self._refuse(str(exc))
            return b""
        if handshake.done:
            self._end_handshake()
            transport.write(reply)
        return rest

    def _end_handshake(self) -> None:
        if self._handshake is not None and self._deadline is not None:
            self._handshake = None
            self._server._num_handshaking -= 1
            self._deadline.cancel()

    def _refuse(self, reason: str) -> None:
        """Close an unauthenticated connection at once; nothing was served on it."""
        transport = self._writer.transport
        if transport is not None and not transport.is_closing():
            self._server._note_refusal(transport.get_extra_info("peername"), reason)
            transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._handshake is not None:
            data = self._authenticate(self._handshake, data)
            if not data:
                return
        try:
            frames = self._codec.feed(data)
        except FrameError as exc:
            logger.warning("request plane: closing connection from a bad peer: %s", exc)
            if self._writer.transport is not None:
                self._writer.transport.close()
            return
        for frame in frames:
            if type(frame) is Open:
                self._open(frame)
            elif type(frame) is Cancel and frame.sid in self._streams:
                self._streams[frame.sid].cancel()

    def _open(self, frame: Open) -> None:
        handler = self._server._handlers.get(frame.endpoint)
        if handler is None or self._server._is_closing:
            reason = "shutting down" if handler else f"no endpoint '{frame.endpoint}' here"
            self._writer.send(Fail(frame.sid, "unavailable", reason, 503, True))
            return
        stats = self._server.stats[frame.endpoint]
        self._streams[frame.sid] = self._loop.create_task(self._serve(frame.sid, handler, frame.body, stats))

    async def _serve(self, sid: int, handler: Handler, body: msgspec.Raw, stats: EndpointStats) -> None:
        server, writer = self._server, self._writer
        server._inflight += 1
        stats.requests += 1
        stats.inflight += 1
        stats.request_bytes += len(body)
        started = time.perf_counter()
        try:
            async with contextlib.aclosing(cast(AsyncGenerator[bytes, None], handler(body))) as items:
                async for item in items:
                    stats.response_bytes += len(item)
                    writer.send(Data(sid, msgspec.Raw(item)))
                    await writer.drained()
            writer.send(End(sid))
        except asyncio.CancelledError:
            stats.cancelled += 1  # cancelled by the caller or the connection dropped; the handler has aborted
        except RequestError as exc:
            stats.errors += 1
            writer.send(Fail(sid, exc.code or "invalid_request", exc.message, exc.status))
        except DynError as exc:
            stats.errors += 1
            migratable = getattr(exc, "is_migratable", False)  # a proxy's lost backend: the caller may retry
            status, retry_after = getattr(exc, "status", 500), getattr(exc, "retry_after", None)
            writer.send(Fail(sid, type(exc).__name__, str(exc), status, migratable, retry_after))
        except Exception as exc:
            stats.errors += 1
            logger.exception("endpoint handler failed")
            writer.send(Fail(sid, "internal", f"{type(exc).__name__}: {exc}", 500))
        finally:
            self._streams.pop(sid, None)
            stats.ended(time.perf_counter() - started)
            server._inflight -= 1
            server._idle_check()

    def pause_writing(self) -> None:
        self._writer.pause()

    def resume_writing(self) -> None:
        self._writer.resume()

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_handshake()
        self._writer.transport = None
        self._writer.resume()
        for task in self._streams.values():
            task.cancel()
        self._server._connections.discard(self)

    def close(self) -> None:
        if self._writer.transport is not None:
            self._writer.transport.close()


class RequestServer:
    """Serves endpoints over TCP; `drain()` waits for in-flight streams, `close()` cancels them.

    With `secret`, every connection must pass the handshake first; without, `host` must be loopback.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret: bytes | None = None) -> None:
        self._host = host
        self._port = port
        self._secret = secret
        self._num_handshaking = 0
        self._num_refused = 0
        self._refusal_logged_at = -REFUSAL_LOG_INTERVAL_S
        self._handlers: dict[str, Handler] = {}
        self.stats: dict[str, EndpointStats] = {}
        """Endpoint -> its counts (requests served, in flight, bytes, durations)."""
        self._connections: set[_ServerConnection] = set()
        self._server: asyncio.Server | None = None
        self._inflight = 0
        self._idle = asyncio.Event()
        self._is_closing = False
        self._address: str | None = None

    @property
    def address(self) -> str:
        """The `host:port` callers should dial; set by `start()`."""
        if self._address is None:
            raise RuntimeError("RequestServer.address read before start()")
        return self._address

    def add_endpoint(self, name: str, handler: Handler) -> None:
        """Serve `handler` under `name`."""
        self._handlers[name] = handler
        self.stats.setdefault(name, EndpointStats())

    async def start(self) -> str:
        """Listen; return the address `host:port` callers should dial. ConfigError if exposed without a secret."""
        check_exposure(self._host, self._secret)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ServerConnection(self), self._host, self._port)
        port = self._server.sockets[0].getsockname()[1]
        host = self._host if self._host not in ("0.0.0.0", "::", "") else socket.gethostname()
        self._address = f"{host}:{port}"
        if self._secret is None:
            logger.warning(
                "request plane %s: no cluster secret, so any process on this host may use it; pass"
                " --cluster-secret-file PATH or DYN_CLUSTER_SECRET",
                self._address,
            )
        return self._address

    @property
    def num_refused(self) -> int:
        """Connections closed for failing the handshake (or for arriving in a flood of them)."""
        return self._num_refused

    def _note_refusal(self, peer: object, reason: str) -> None:
        self._num_refused += 1
        now = time.monotonic()
        if now - self._refusal_logged_at >= REFUSAL_LOG_INTERVAL_S:
            self._refusal_logged_at = now
            logger.warning(
                "request plane %s: refused a connection from %s: %s (%d refused so far)",
                self._address,
                peer,
                reason,
                self._num_refused,
            )

    @property
    def num_inflight(self) -> int:
        """Streams being served now."""
        return self._inflight

    def _idle_check(self) -> None:
        if self._inflight == 0:
            self._idle.set()

    async def drain(self, timeout: float) -> bool:
        """Refuse new streams and wait up to `timeout` s for in-flight ones; True if all finished."""
        self._is_closing = True
        if self._inflight == 0:
            return True
        self._idle.clear()
        try:
            async with asyncio.timeout(timeout):
                while self._inflight:
                    await self._idle.wait()
                    self._idle.clear()
            return True
        except TimeoutError:
            return False

    async def close(self) -> None:
        """Stop listening and drop every connection (cancelling its streams). Idempotent."""
        self._is_closing = True
        if self._server is not None:
            self._server.close()
            for conn in list(self._connections):
                conn.close()
            await self._server.wait_closed()
            self._server = None


##### Client #####


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
        self._writer = _Writer(self._loop)
        self._streams: dict[int, ResponseStream] = {}
        self._ids = itertools.count(1)
        self._connecting: asyncio.Lock = asyncio.Lock()
        self._throttled: set[int] = set()
        self._closed = False

    @property
    def num_streams(self) -> int:
        """Streams open on this connection."""
        return len(self._streams)

    async def open_stream(self, endpoint: str, body: bytes) -> ResponseStream:
        """Start a stream; raise WorkerDisconnected if the server cannot be reached."""
        if self._writer.transport is None or self._writer.transport.is_closing():
            await self._connect()
        stream = ResponseStream(self, next(self._ids))
        self._streams[stream.sid] = stream
        self._writer.send(Open(stream.sid, endpoint, msgspec.Raw(body)))
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
            self._writer = _Writer(self._loop)
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
