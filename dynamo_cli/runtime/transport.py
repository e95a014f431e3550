"""The TCP request plane: many concurrent response streams multiplexed on one connection per peer.

`RequestServer` serves endpoints declared with their types (wire.py's `EndpointSpec`, seen here as a `Spec`): it
decodes each request once and hands it to the endpoint's handler, which yields reply items that it encodes (or bytes,
already encoded: a relay); a body that is not the endpoint's request fails alone, as the caller's error (400).
`RequestClient` (request_client.py) holds one connection to one server and opens streams on it. Writes are coalesced
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
import logging
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

import msgspec

from dynamo_cli.errors import (
    ConfigError,
    DynError,
    RequestError,
)
from dynamo_cli.runtime.framing import Cancel, Data, End, Fail, Frame, FrameCodec, FrameError, Open
from dynamo_cli.runtime.handshake import (
    HANDSHAKE_TIMEOUT_S,
    HandshakeError,
    ServerHandshake,
    is_loopback,
)
from dynamo_cli.runtime.stats import EndpointStats

logger = logging.getLogger(__name__)

Req_co = TypeVar("Req_co", covariant=True)
Rep_co = TypeVar("Rep_co", covariant=True)
Req = TypeVar("Req")


class Spec(Protocol[Req_co, Rep_co]):
    """An endpoint's declaration, as the request plane uses it (wire.py's `EndpointSpec`): its name, its request's
    decoder (RequestError for a body that is not one), its reply's decoder and the encoder of both."""

    @property
    def name(self) -> str: ...

    def decode_request(self, body: bytes) -> Req_co: ...

    def decode_reply(self, body: bytes) -> Rep_co: ...

    def encode(self, message: object) -> bytes: ...


Handler = Callable[[Any], AsyncIterator[Any]]
"""An endpoint's work: its decoded request in, reply items out (bytes pass as already encoded); cancelled when the
caller cancels."""


@dataclass(frozen=True, slots=True)
class _Served:
    spec: Spec[Any, Any]
    handler: Handler
    stats: EndpointStats


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


class FrameWriter:
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

    def send_now(self, frame: Frame) -> None:
        """`send`, written at once with whatever is pending (a new stream's request should not wait for the event
        loop's turn: in a burst of arrivals that turn comes after every other arrival's preparation)."""
        self._pending.append(self._codec.encode(frame))
        self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return  # written by send_now before this callback's turn
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
        self._writer = FrameWriter(self._loop)
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
        served = self._server._endpoints.get(frame.endpoint)
        if served is None or self._server._is_closing:
            reason = "shutting down" if served else f"no endpoint '{frame.endpoint}' here"
            self._writer.send(Fail(frame.sid, "unavailable", reason, 503, True))
            return
        self._streams[frame.sid] = self._loop.create_task(self._serve(frame.sid, served, frame.body))

    async def _serve(self, sid: int, served: _Served, body: msgspec.Raw) -> None:
        server, writer, stats, encode = self._server, self._writer, served.stats, served.spec.encode
        server._inflight += 1
        stats.requests += 1
        stats.inflight += 1
        stats.request_bytes += len(body)
        started = time.perf_counter()
        try:
            request = served.spec.decode_request(body)
            async with contextlib.aclosing(cast(AsyncGenerator[Any, None], served.handler(request))) as items:
                async for item in items:
                    if type(item) is not bytes:
                        item = encode(item)
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
            # is_migratable: a proxy's lost backend, which the caller may retry elsewhere
            writer.send(Fail(sid, type(exc).__name__, str(exc), exc.status, exc.is_migratable, exc.retry_after))
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
        self._endpoints: dict[str, _Served] = {}
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

    def add_endpoint(
        self, spec: Spec[Req, Any], handler: Callable[[Req], AsyncIterator[Any]], *, name: str | None = None
    ) -> None:
        """Serve `handler` for `spec`'s requests, under `name` where the deployment names it (`--endpoint`)."""
        name = name or spec.name
        self._endpoints[name] = _Served(spec, handler, self.stats.setdefault(name, EndpointStats()))

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
