"""The request plane's handshake as pure functions: both sides prove the secret, nothing else gets through."""

from __future__ import annotations

import struct

import msgspec
import pytest

from dynamo_cli.runtime.framing import FrameCodec, Open
from dynamo_cli.runtime.handshake import (
    ANSWER_BYTES,
    MAGIC,
    ClientHandshake,
    HandshakeError,
    ServerHandshake,
    client_proof,
    frame,
    is_loopback,
    server_proof,
)

SECRET = bytes(range(32))
OTHER = bytes(range(1, 33))


def run(server: ServerHandshake, client: ClientHandshake) -> bytes:
    """Drive both sides to the end; the bytes the server got past the handshake."""
    answer, rest = client.feed(server.hello())
    assert rest == b"" and not client.done
    confirm, past = server.feed(answer)
    assert server.done
    assert client.feed(confirm) == (b"", b"")
    assert client.done
    return past


def test_both_sides_with_the_secret_prove_it_to_each_other() -> None:
    assert run(ServerHandshake(SECRET), ClientHandshake(SECRET)) == b""


def test_messages_may_arrive_one_byte_at_a_time_and_frames_after_them_are_kept() -> None:
    server, client = ServerHandshake(SECRET), ClientHandshake(SECRET)
    answer = b""
    for byte in server.hello():
        sent, _ = client.feed(bytes([byte]))
        answer += sent
    confirm = b""
    stream = answer + b"FRAMES"
    for i, byte in enumerate(stream):
        sent, past = server.feed(bytes([byte]))
        confirm += sent
        if server.done:
            assert past + stream[i + 1 :] == b"FRAMES"
            break
    for byte in confirm:
        client.feed(bytes([byte]))
    assert client.done


def test_a_client_without_the_secret_is_refused() -> None:
    server, client = ServerHandshake(SECRET), ClientHandshake(OTHER)
    answer, _ = client.feed(server.hello())
    with pytest.raises(HandshakeError, match="does not hold"):
        server.feed(answer)
    assert not server.done


def test_a_server_without_the_secret_is_refused_by_the_client() -> None:
    impostor, client = ServerHandshake(OTHER), ClientHandshake(SECRET)
    client.feed(impostor.hello())
    with pytest.raises(HandshakeError, match="could not prove"):
        client.feed(frame(server_proof(OTHER, impostor.nonce, client.nonce)))
    assert not client.done


def test_a_recorded_answer_does_not_open_another_connection() -> None:
    first = ServerHandshake(SECRET)
    answer, _ = ClientHandshake(SECRET).feed(first.hello())
    first.feed(answer)
    with pytest.raises(HandshakeError):
        ServerHandshake(SECRET).feed(answer)  # a fresh server nonce


def test_a_server_proof_reflected_back_is_not_a_client_proof() -> None:
    server = ServerHandshake(SECRET)
    nonce = b"n" * 32
    reflected = server_proof(SECRET, server.nonce, nonce) + nonce
    with pytest.raises(HandshakeError):
        server.feed(frame(reflected))


@pytest.mark.parametrize("length", [0, ANSWER_BYTES - 1, ANSWER_BYTES + 1, 2**31])
def test_a_message_of_the_wrong_size_is_refused_before_it_is_buffered(length: int) -> None:
    with pytest.raises(HandshakeError, match="expected"):
        ServerHandshake(SECRET).feed(struct.pack(">I", length))


def test_a_request_frame_sent_instead_of_an_answer_is_refused() -> None:
    open_frame = FrameCodec().encode(Open(1, "generate", msgspec.Raw(msgspec.msgpack.encode({"x": 1}))))
    with pytest.raises(HandshakeError):
        ServerHandshake(SECRET).feed(open_frame)


def test_a_hello_that_is_not_dyns_is_refused() -> None:
    with pytest.raises(HandshakeError, match="not dyn's"):
        ClientHandshake(SECRET).feed(frame(b"x" * len(MAGIC) + b"n" * 32))


def test_proofs_depend_on_every_input() -> None:
    base = client_proof(SECRET, b"s" * 32, b"c" * 32)
    assert base != client_proof(OTHER, b"s" * 32, b"c" * 32)
    assert base != client_proof(SECRET, b"t" * 32, b"c" * 32)
    assert base != client_proof(SECRET, b"s" * 32, b"d" * 32)
    assert base != server_proof(SECRET, b"s" * 32, b"c" * 32)


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("", False),
        ("::", False),
        ("10.0.0.1", False),
        ("example.com", False),
    ],
)
def test_only_loopback_addresses_count_as_loopback(host: str, expected: bool) -> None:
    assert is_loopback(host) is expected
