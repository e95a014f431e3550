"""The KV transfer plane: a decode worker pulls a KV payload (raw bytes) from the prefill worker that holds it.

A data plane beside the request plane, which only carries the reference (address, transfer id, size).
`KvTransferServer.offer()` keeps a payload under a fresh 128-bit id (the capability to read it) until it
is pulled once, released, or `ttl_s` passes; `KvTransferClient.pull()` fetches it. One TCP connection
per pull:

    client ⇄ server   the request plane's mutual HMAC handshake (handshake.py), when a secret is set
    client → server   request: transfer id (16 raw bytes) | mode (1 byte: 0 stream it, 1 NIXL)
    server → client   header:  status (1 byte: 0 ok, 1 unknown id) | length (8 bytes, big-endian)
    server → client   mode 0: `length` raw bytes, in CHUNK_BYTES slices (no framing, no base64, no cap
                      but the server's byte budget); mode 1: nothing, the client READs the payload with
                      NIXL (kv_transfer_nixl.py) and sends one ack byte

NOTE: the request claims the payload: whatever happens next (the bytes sent, the client gone, a stall),
it is freed when this connection ends, so a payload is served at most once and never held past its
pull. A stranger gets nothing: a wrong handshake, a late or malformed request, an unknown id or a
connection over MAX_CONNECTIONS is cut off having been served no byte, and every wait on the peer has
a timeout, so a slow peer holds one connection slot for at most that long.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import secrets
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

from dynamo_cli.errors import KvTransferFull, TransferFailed
from dynamo_cli.runtime import handshake
from dynamo_cli.runtime.kv_transfer_nixl import NixlSink, NixlSource
from dynamo_cli.runtime.transport import check_exposure

logger = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20
"""Bytes per write (server) and at most per read (client): large enough for GB/s, small enough to pace."""
MAX_CONNECTIONS = 64
"""Connections a server serves at once; more are closed at once (a flood costs little)."""
REQUEST_TIMEOUT_S = handshake.HANDSHAKE_TIMEOUT_S
"""How long a server waits for the handshake and the request together."""
STALL_TIMEOUT_S = 30.0
"""How long a server waits for one chunk to drain, or for a NIXL reader's ack."""
NIXL_PROGRESS_S = 0.0005
"""While a NIXL read of a payload is in flight, the source drives its agent this often (no progress thread)."""
DEFAULT_MAX_BYTES = 8 << 30
"""Default byte budget of payloads held at once."""
MODE_STREAM, MODE_NIXL = 0, 1
STATUS_OK, STATUS_UNKNOWN = 0, 1
_REQUEST = struct.Struct(">16sB")
_HEADER = struct.Struct(">BQ")


@dataclass(frozen=True, slots=True)
class Offer:
    """A payload held for one pull: what the prefill worker advertises (as a BlobRef) next to its address."""

    transfer_id: str
    """128 random bits, hex: names the payload and is the capability to read it."""
    nbytes: int
    """The payload's size; the puller allocates exactly this much."""
    nixl: bytes | None
    """An encoded NixlOffer when the server registered the payload with NIXL; None: TCP only."""


@dataclass(frozen=True, slots=True)
class Pulled:
    """A payload fetched by `KvTransferClient.pull()`."""

    payload: bytearray
    """Exactly the offered bytes."""
    seconds: float
    """Wall time of the pull, connect to last byte."""
    backend: str
    """"tcp" or "nixl"."""


@dataclass(frozen=True, slots=True)
class TransferStats:
    """A server's counters since start."""

    num_offered: int
    """Payloads offered."""
    num_pulled: int
    """Payloads served in full (TCP) or acknowledged (NIXL)."""
    num_expired: int
    """Payloads freed unpulled after ttl_s."""
    num_released: int
    """Payloads freed by `release()` (the client left before decode)."""
    num_failed: int
    """Payloads claimed whose serving failed (the puller left, stalled or never acknowledged)."""
    num_refused: int
    """Connections cut off before any byte was served (handshake, request, unknown id, flood)."""
    bytes_served: int
    """Payload bytes served in full."""


@dataclass(slots=True)
class _Held:
    payload: bytes | bytearray | memoryview
    expires_at: float
    is_claimed: bool = False


class KvTransferServer:
    """Holds offered payloads and serves each to one puller; see the module docstring for the wire.

    With `secret`, every connection must pass the cluster-secret handshake; without, `host` must be
    loopback. `use_nixl` registers payloads with NIXL too (when it imports; TCP otherwise).
    """

    def __init__(
        self,
        host: str,
        port: int = 0,
        *,
        secret: bytes | None,
        ttl_s: float = 60.0,
        max_bytes: int = DEFAULT_MAX_BYTES,
        use_nixl: bool = False,
    ) -> None:
        self._host, self._port, self._secret = host, port, secret
        self._ttl_s = ttl_s
        self._max_bytes = max_bytes
        self._use_nixl = use_nixl
        self._nixl: NixlSource | None = None
        self._held: dict[str, _Held] = {}
        self._bytes_held = 0
        self._num_connections = 0
        self._counts = {field.name: 0 for field in dataclasses.fields(TransferStats)}
        self._server: asyncio.Server | None = None
        self._expiry: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        """Listen (and make the NIXL agent when asked); the `host:port` pullers should dial."""
        check_exposure(self._host, self._secret, "KV transfer plane")
        if self._use_nixl:
            self._nixl = await NixlSource.create()
            if self._nixl is None:
                logger.warning("KV transfer: NIXL is not usable here; serving over TCP only")
        self._server = await asyncio.start_server(self._accept, self._host, self._port)
        port = self._server.sockets[0].getsockname()[1]
        host = self._host if self._host not in ("0.0.0.0", "::", "") else socket.gethostname()
        self._expiry = asyncio.get_running_loop().create_task(self._expire_loop())
        return f"{host}:{port}"

    def offer(self, payload: bytes | bytearray | memoryview) -> Offer:
        """Hold `payload` (not copied: do not change it) for one pull; KvTransferFull over the byte budget."""
        nbytes = memoryview(payload).nbytes
        if self._bytes_held + nbytes > self._max_bytes:
            raise KvTransferFull(nbytes, self._bytes_held, self._max_bytes)
        transfer_id = secrets.token_hex(16)
        nixl = self._nixl.register(transfer_id, payload) if self._nixl is not None and nbytes else None
        self._held[transfer_id] = _Held(payload, time.monotonic() + self._ttl_s)
        self._bytes_held += nbytes
        self._counts["num_offered"] += 1
        return Offer(transfer_id, nbytes, nixl)

    def release(self, transfer_id: str) -> bool:
        """Free a payload nobody will pull; False if unknown or already being pulled (freed after that)."""
        held = self._held.get(transfer_id)
        if held is None or held.is_claimed:
            return False
        self._free(transfer_id, "num_released")
        return True

    def held(self) -> tuple[int, int]:
        """(payloads held, bytes held), those being pulled included."""
        return len(self._held), self._bytes_held

    @property
    def stats(self) -> TransferStats:
        """The counters so far."""
        return TransferStats(**self._counts)

    async def close(self) -> None:
        """Stop listening, cut every connection and free every payload. Idempotent."""
        if self._server is not None:
            self._server.close()
            self._server = None
        tasks = [t for t in (self._expiry, *self._connections) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for transfer_id in list(self._held):
            self._free(transfer_id, None)
        if self._nixl is not None:
            self._nixl.close()

    def _free(self, transfer_id: str, counter: str | None) -> None:
        held = self._held.pop(transfer_id, None)
        if held is None:
            return
        if self._nixl is not None:
            self._nixl.deregister(transfer_id)  # before the payload can be collected
        self._bytes_held -= memoryview(held.payload).nbytes
        if counter is not None:
            self._counts[counter] += 1

    async def _expire_loop(self) -> None:
        tick = max(0.01, min(1.0, self._ttl_s / 4))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for transfer_id in [k for k, h in self._held.items() if not h.is_claimed and h.expires_at <= now]:
                logger.debug("KV transfer: %s… expired unpulled after %.0f s", transfer_id[:8], self._ttl_s)
                self._free(transfer_id, "num_expired")

    ##### Serving one connection #####

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._num_connections += 1
        self._connections.add(task)
        try:
            if self._num_connections > MAX_CONNECTIONS:
                self._refuse(writer, f"over {MAX_CONNECTIONS} connections at once")
                writer.transport.abort()
            else:
                await self._serve(reader, writer)
                writer.close()  # everything was drained: a plain close, so the last bytes are not reset
        except (OSError, asyncio.IncompleteReadError, TimeoutError, handshake.HandshakeError) as exc:
            self._refuse(writer, f"{type(exc).__name__}: {exc}")
            writer.transport.abort()
        finally:
            self._num_connections -= 1
            self._connections.discard(task)
            if not writer.transport.is_closing():
                writer.transport.abort()  # cancelled (close())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            rest = await self._authenticate(reader, writer)
            transfer_id, mode = await self._read_request(reader, rest)
        held = self._held.get(transfer_id)
        if held is None or held.is_claimed:
            writer.write(_HEADER.pack(STATUS_UNKNOWN, 0))
            self._refuse(writer, "unknown transfer id (never offered, expired, released or pulled)")
            return
        held.is_claimed = True
        counter = "num_failed"
        try:
            writer.write(_HEADER.pack(STATUS_OK, memoryview(held.payload).nbytes))
            if mode == MODE_NIXL and self._nixl is not None:
                await self._await_ack(reader, self._nixl)
            else:
                await self._send(writer, memoryview(held.payload))
            counter = "num_pulled"
        finally:
            self._free(transfer_id, counter)

    async def _authenticate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        if self._secret is None:
            return b""

        async def send(data: bytes) -> None:
            writer.write(data)
            await writer.drain()

        return await handshake.drive(
            handshake.ServerHandshake(self._secret), lambda: reader.read(handshake.MAX_MESSAGE_BYTES + 4), send
        )

    @staticmethod
    async def _read_request(reader: asyncio.StreamReader, rest: bytes) -> tuple[str, int]:
        if len(rest) > _REQUEST.size:
            raise handshake.HandshakeError("more than one request on a connection")
        data = rest + await reader.readexactly(_REQUEST.size - len(rest))
        raw_id, mode = _REQUEST.unpack(data)
        return raw_id.hex(), mode

    async def _send(self, writer: asyncio.StreamWriter, view: memoryview) -> None:
        for start in range(0, view.nbytes, CHUNK_BYTES):
            writer.write(view[start : start + CHUNK_BYTES])
            async with asyncio.timeout(STALL_TIMEOUT_S):
                await writer.drain()
        self._counts["bytes_served"] += view.nbytes

    @staticmethod
    async def _await_ack(reader: asyncio.StreamReader, nixl: NixlSource) -> None:
        """Progress the source's agent until the puller's ack byte comes (its READ is then complete)."""
        ack = asyncio.ensure_future(reader.readexactly(1))
        try:
            async with asyncio.timeout(STALL_TIMEOUT_S):
                while not ack.done():
                    nixl.progress()
                    await asyncio.wait((ack,), timeout=NIXL_PROGRESS_S)
            ack.result()
        finally:
            ack.cancel()

    def _refuse(self, writer: asyncio.StreamWriter, reason: str) -> None:
        self._counts["num_refused"] += 1
        logger.debug("KV transfer: refused %s: %s", writer.get_extra_info("peername"), reason)


class KvTransferClient:
    """Pulls payloads from KvTransferServers; every wait is bounded by `timeout_s` (per read).

    NIXL is used when the offer has NIXL metadata and NIXL imports here (its agent made on first use).
    """

    def __init__(self, *, secret: bytes | None, timeout_s: float = 30.0, use_nixl: bool = True) -> None:
        self._secret = secret
        self._timeout_s = timeout_s
        self._nixl = NixlSink() if use_nixl else None

    async def prepare(self) -> None:
        """Import NIXL now (off the loop), not on the first pull."""
        if self._nixl is not None:
            await self._nixl.is_available()

    async def pull(self, address: str, transfer_id: str, nbytes: int, nixl: bytes | None = None) -> Pulled:
        """Fetch the payload `transfer_id` of `nbytes` from `address`; TransferFailed on any failure."""
        started = time.perf_counter()
        use_nixl = nixl is not None and self._nixl is not None and await self._nixl.is_available()
        try:
            raw_id = bytes.fromhex(transfer_id)
            if len(raw_id) != 16:
                raise ValueError("a transfer id is 32 hex digits")
            sock = await self._connect(address)
            try:
                payload = await self._fetch(sock, raw_id, nbytes, nixl if use_nixl else None)
            finally:
                sock.close()
        except TransferFailed:
            raise
        except (OSError, ValueError, RuntimeError, TimeoutError, handshake.HandshakeError) as exc:
            reason = str(exc) or type(exc).__name__
            if isinstance(exc, TimeoutError):
                reason = f"no progress within {self._timeout_s:g} s"
            raise TransferFailed(address, transfer_id, reason) from exc
        return Pulled(payload, time.perf_counter() - started, "nixl" if use_nixl else "tcp")

    async def close(self) -> None:
        """Drop the NIXL agent, if one was made. Idempotent."""
        if self._nixl is not None:
            self._nixl.close()

    async def _connect(self, address: str) -> socket.socket:
        loop = asyncio.get_running_loop()
        host, _, port = address.rpartition(":")
        async with asyncio.timeout(self._timeout_s):
            family, target = await _resolve(host.strip("[]"), int(port))
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, target)
            except BaseException:
                sock.close()
                raise
        return sock

    async def _fetch(self, sock: socket.socket, raw_id: bytes, nbytes: int, nixl: bytes | None) -> bytearray:
        loop = asyncio.get_running_loop()
        if self._secret is not None:
            async with asyncio.timeout(min(self._timeout_s, handshake.HANDSHAKE_TIMEOUT_S)):
                rest = await handshake.drive(
                    handshake.ClientHandshake(self._secret),
                    lambda: loop.sock_recv(sock, handshake.MAX_MESSAGE_BYTES + 4),
                    lambda data: loop.sock_sendall(sock, data),
                )
            if rest:
                raise handshake.HandshakeError("the server sent bytes before the request")
        await loop.sock_sendall(sock, _REQUEST.pack(raw_id, MODE_STREAM if nixl is None else MODE_NIXL))
        header = bytearray(_HEADER.size)
        await self._receive_into(sock, memoryview(header))
        status, length = _HEADER.unpack(header)
        if status != STATUS_OK:
            raise ValueError("the server holds no such payload (never offered, expired, released or pulled)")
        if length != nbytes:
            raise ValueError(f"the server holds {length} bytes under this id, not the {nbytes} expected")
        if nixl is None:
            payload = bytearray(nbytes)
            await self._receive_into(sock, memoryview(payload))
        else:
            assert self._nixl is not None
            async with asyncio.timeout(self._timeout_s):
                payload = await self._nixl.read(nixl, nbytes)
            await loop.sock_sendall(sock, b"\x01")
        await self._await_close(sock)
        return payload

    async def _await_close(self, sock: socket.socket) -> None:
        """Wait for the server to close, which it does once it freed the payload: a pull that returned left
        nothing held. The payload is complete already, so a server slow to close costs time, not the pull."""
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(self._timeout_s):
                await asyncio.get_running_loop().sock_recv(sock, 1)

    async def _receive_into(self, sock: socket.socket, view: memoryview) -> None:
        loop = asyncio.get_running_loop()
        done = 0
        while done < view.nbytes:
            async with asyncio.timeout(self._timeout_s):
                received = await loop.sock_recv_into(sock, view[done : done + CHUNK_BYTES])
            if received == 0:
                raise ValueError(f"the server closed the connection after {done} of {view.nbytes} bytes")
            done += received


async def _resolve(host: str, port: int) -> tuple[int, Any]:
    """The address family and socket address of `host:port`: an IP address as it is (a decode worker pulls from
    the address its prefill worker advertised; a resolver thread per pull costs a hop on a loaded machine),
    a name through the resolver."""
    try:
        version = ipaddress.ip_address(host).version
    except ValueError:
        found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, target = found[0]
        return family, target
    return (socket.AF_INET6 if version == 6 else socket.AF_INET), (host, port)
