"""Request-plane frames: a 4-byte big-endian length, then one msgpack-encoded tagged frame.

Streams are multiplexed on one connection by a stream id the caller picks. Caller → server:
`Open` (start a stream on an endpoint) and `Cancel`. Server → caller: `Data` (one response item),
`End` (the stream finished) and `Fail` (it failed; `is_migratable` says whether another instance may
retry). Bodies are opaque msgpack (`msgspec.Raw`), so the runtime never decodes LLM payloads.
"""

from __future__ import annotations

import struct

import msgspec

MAX_FRAME = 32 * 1024 * 1024
"""Largest frame accepted (Dynamo's DYN_TCP_MAX_MESSAGE_SIZE); bigger ones close the connection."""

_LEN = struct.Struct(">I")


class Open(msgspec.Struct, tag=1, array_like=True, frozen=True):
    sid: int
    endpoint: str
    body: msgspec.Raw


class Cancel(msgspec.Struct, tag=2, array_like=True, frozen=True):
    sid: int


class Data(msgspec.Struct, tag=3, array_like=True, frozen=True, gc=False):
    sid: int
    body: msgspec.Raw


class End(msgspec.Struct, tag=4, array_like=True, frozen=True):
    sid: int


class Fail(msgspec.Struct, tag=5, array_like=True, frozen=True):
    sid: int
    code: str
    message: str
    status: int = 500
    is_migratable: bool = False
    retry_after: float | None = None
    """An Overloaded's hint (seconds), for the caller's `Retry-After`; last, so older peers' frames decode."""


Frame = Open | Cancel | Data | End | Fail


class FrameError(Exception):
    """The peer sent something that is not a valid frame; the connection must close."""


class FrameCodec:
    """Encode frames with their length prefix; decode a byte stream into frames."""

    __slots__ = ("_buffer", "_decoder", "_encoder")

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Frame)
        self._buffer = bytearray()

    def encode(self, frame: Frame) -> bytes:
        body = self._encoder.encode(frame)
        return _LEN.pack(len(body)) + body

    def feed(self, data: bytes) -> list[Frame]:
        """Append received bytes and return every complete frame (raise FrameError on garbage)."""
        if self._buffer:
            self._buffer += data
            data = bytes(self._buffer)
            self._buffer.clear()
        # Raw bodies keep a view of `data`, so frames are decoded from an immutable bytes object.
        view = memoryview(data)
        frames: list[Frame] = []
        pos, size = 0, len(data)
        while size - pos >= 4:
            (length,) = _LEN.unpack_from(data, pos)
            if length > MAX_FRAME:
                raise FrameError(f"frame of {length} bytes exceeds the {MAX_FRAME}-byte limit")
            end = pos + 4 + length
            if end > size:
                break
            try:
                frames.append(self._decoder.decode(view[pos + 4 : end]))
            except msgspec.DecodeError as exc:
                raise FrameError(f"undecodable frame: {exc}") from exc
            pos = end
        if pos < size:
            self._buffer += view[pos:]
        return frames
