"""Mutual challenge–response authentication of a request-plane connection with the cluster secret.

Every process of one deployment holds the same random secret (`dyn serve` makes one; multi-node
scripts pass one). Before any frame is served, each side of a new connection proves it holds the
secret without sending it, and the server learns nothing else about the caller:

    server → client   hello:   MAGIC | server_nonce                                   (42 bytes)
    client → server   answer:  HMAC(secret, "client" | server_nonce | client_nonce) | client_nonce
    server → client   confirm: HMAC(secret, "server" | server_nonce | client_nonce)

Each message is framed like a request-plane frame (4-byte big-endian length) and must have its exact
size, which caps what an unauthenticated peer can make the server buffer. Proofs are compared with
`hmac.compare_digest`. Fresh nonces on both sides mean a recorded exchange cannot be replayed, and
the "client"/"server" labels mean a proof cannot be reflected back to the side that asked for it. A
peer that answers wrongly, sends something else, or takes longer than HANDSHAKE_TIMEOUT_S is cut off
having been served nothing. The client sends no request until the server has proved itself, so a
process that merely squats on a worker's address never sees a prompt.

Why a shared secret and not mutual TLS: a deployment needs no PKI (no CA, no per-host certificates
to issue, rotate and revoke), just one random secret per deployment that `dyn serve` can create on
its own; the cost is two HMAC-SHA256 and one extra round trip once per connection, and connections
are long-lived and carry many multiplexed streams, so nothing is added per request or per frame.

What it does NOT give: confidentiality or integrity on the wire. Frames after the handshake travel in
clear, so an on-path observer reads prompts and tokens, and an active on-path attacker could inject
frames into an authenticated connection. Where the network between hosts is not trusted, run the
request plane over a private network, a VPN (WireGuard) or TLS — the path to that is wrapping these
connections in TLS (`ssl=` on the same asyncio calls), which this module would then sit inside.

Pure protocol: no sockets, no clock. `transport.py` drives it from its protocol callbacks; stream and
socket users (the KV transfer plane) call `drive()` with their own receive and send, inside their timeout.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import struct
from collections.abc import Awaitable, Callable

MAGIC = b"dyn-auth-1"
"""Starts the server's hello: names the protocol and its version."""
NONCE_BYTES = 32
PROOF_BYTES = 32
"""HMAC-SHA256 digest size."""
MIN_SECRET_BYTES = 16
"""Shortest secret accepted (128 bits)."""
SECRET_BYTES = 32
"""Size of the secret `dyn serve` makes (256 bits)."""
HANDSHAKE_TIMEOUT_S = 10.0
"""How long either side waits for the whole handshake before closing the connection. Generous: a
worker whose event loop is starved (engine processes spinning on a small CPU) must not look like a
stranger; MAX_HANDSHAKING bounds what a slow peer can hold meanwhile."""

HELLO_BYTES = len(MAGIC) + NONCE_BYTES
ANSWER_BYTES = PROOF_BYTES + NONCE_BYTES
CONFIRM_BYTES = PROOF_BYTES
MAX_MESSAGE_BYTES = max(HELLO_BYTES, ANSWER_BYTES, CONFIRM_BYTES)
"""The size cap on a handshake message (each must also have its exact size)."""

_LEN = struct.Struct(">I")


class HandshakeError(Exception):
    """The peer failed the handshake (wrong proof, wrong message); the connection must close."""


def new_secret() -> bytes:
    """A fresh random cluster secret."""
    return secrets.token_bytes(SECRET_BYTES)


def client_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """What the client sends to prove it holds `secret`."""
    return hmac.new(secret, b"client" + server_nonce + client_nonce, hashlib.sha256).digest()


def server_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """What the server sends back to prove it holds `secret` too."""
    return hmac.new(secret, b"server" + server_nonce + client_nonce, hashlib.sha256).digest()


def frame(message: bytes) -> bytes:
    """`message` with its length prefix."""
    return _LEN.pack(len(message)) + message


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or `localhost`) reaches this machine only; names resolve to False."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class _Reader:
    """Buffers bytes until one message of an expected size is complete."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = bytearray()

    def take(self, data: bytes, size: int) -> bytes | None:
        """The next message if complete (it must be `size` bytes long), else None."""
        self._buffer += data
        if len(self._buffer) < _LEN.size:
            return None
        (length,) = _LEN.unpack_from(self._buffer)
        if length != size:
            raise HandshakeError(f"handshake message of {length} bytes where {size} were expected")
        end = _LEN.size + size
        if len(self._buffer) < end:
            return None
        message = bytes(self._buffer[_LEN.size : end])
        del self._buffer[:end]
        return message

    def rest(self) -> bytes:
        """Bytes received after the last message (request-plane frames that followed it)."""
        rest = bytes(self._buffer)
        self._buffer.clear()
        return rest


class ServerHandshake:
    """The server's side: send `hello()` on connect, then `feed()` what arrives until `done`."""

    __slots__ = ("_reader", "_secret", "done", "nonce")

    def __init__(self, secret: bytes, nonce: bytes | None = None) -> None:
        self._secret = secret
        self._reader = _Reader()
        self.nonce = nonce or secrets.token_bytes(NONCE_BYTES)
        self.done = False
        """The client proved it holds the secret."""

    def hello(self) -> bytes:
        """The first bytes to send."""
        return frame(MAGIC + self.nonce)

    def feed(self, data: bytes) -> tuple[bytes, bytes]:
        """(bytes to send, bytes past the handshake); HandshakeError if the client's proof is wrong."""
        answer = self._reader.take(data, ANSWER_BYTES)
        if answer is None:
            return b"", b""
        proof, client_nonce = answer[:PROOF_BYTES], answer[PROOF_BYTES:]
        if not hmac.compare_digest(proof, client_proof(self._secret, self.nonce, client_nonce)):
            raise HandshakeError("wrong proof: the peer does not hold this deployment's cluster secret")
        self.done = True
        return frame(server_proof(self._secret, self.nonce, client_nonce)), self._reader.rest()


class ClientHandshake:
    """The client's side: `feed()` what arrives (answering the hello) until `done`; send nothing else before."""

    __slots__ = ("_reader", "_secret", "_server_nonce", "done", "nonce")

    def __init__(self, secret: bytes, nonce: bytes | None = None) -> None:
        self._secret = secret
        self._reader = _Reader()
        self._server_nonce: bytes | None = None
        self.nonce = nonce or secrets.token_bytes(NONCE_BYTES)
        self.done = False
        """The server proved it holds the secret."""

    def feed(self, data: bytes) -> tuple[bytes, bytes]:
        """(bytes to send, bytes past the handshake); HandshakeError if the server is not one of ours."""
        reply = b""
        if self._server_nonce is None:
            hello = self._reader.take(data, HELLO_BYTES)
            if hello is None:
                return b"", b""
            if not hello.startswith(MAGIC):
                raise HandshakeError("the peer's hello is not dyn's handshake (another service, or another version)")
            self._server_nonce = hello[len(MAGIC) :]
            reply, data = frame(client_proof(self._secret, self._server_nonce, self.nonce) + self.nonce), b""
        confirm = self._reader.take(data, CONFIRM_BYTES)
        if confirm is None:
            return reply, b""
        if not hmac.compare_digest(confirm, server_proof(self._secret, self._server_nonce, self.nonce)):
            raise HandshakeError("the server could not prove it holds this deployment's cluster secret")
        self.done = True
        return reply, self._reader.rest()


async def drive(
    handshake: ServerHandshake | ClientHandshake,
    receive: Callable[[], Awaitable[bytes]],
    send: Callable[[bytes], Awaitable[None]],
) -> bytes:
    """Run `handshake` to the end over `receive`/`send`; the bytes received past it.

    HandshakeError if the peer answers wrongly or closes first. The caller owns the timeout (wrap this in
    `asyncio.timeout(HANDSHAKE_TIMEOUT_S)`) and closes the connection on any error.
    """
    if isinstance(handshake, ServerHandshake):
        await send(handshake.hello())
    rest = b""
    while not handshake.done:
        data = await receive()
        if not data:
            raise HandshakeError("the peer closed the connection during the handshake")
        reply, rest = handshake.feed(data)
        if reply:
            await send(reply)
    return rest
