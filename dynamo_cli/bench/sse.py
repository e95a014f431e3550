"""An incremental parser of one HTTP/1.1 response whose body may be a server-sent-event stream; pure.

`Response.feed(bytes, now)` accepts the bytes of a response in pieces of any size, undoes Content-Length,
chunked or read-until-close framing, and collects the payload of every SSE `data:` line with the time
its read arrived (`events`). `[DONE]` sets `saw_done`. A non-SSE or non-200 body is kept (capped) in
`body`, for the error message. `is_done` turns true at the end of the response.
"""

from __future__ import annotations

import enum
from itertools import repeat

__all__ = ["Response"]

_MAX_ERROR_BODY = 64 * 1024


class _Framing(enum.Enum):
    HEAD = 0  # reading the status line and headers
    LENGTH = 1  # body delimited by Content-Length
    CHUNKED = 2  # Transfer-Encoding: chunked
    UNTIL_CLOSE = 3  # no length, no chunking: the body ends when the server closes
    DONE = 4  # the response is complete


def _chunk_size(line: bytes) -> int:
    try:
        return int(line, 16)
    except ValueError:
        return int(line.split(b";", 1)[0], 16)  # a chunk extension


class Response:
    """Incremental parser of one HTTP/1.1 response whose body may be an SSE stream."""

    __slots__ = (
        "status",
        "headers",
        "is_sse",
        "keep_alive",
        "events",
        "body",
        "saw_done",
        "_framing",
        "_rest",
        "_left",
        "_in_trailer",
        "_line",
    )

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.is_sse = False
        self.keep_alive = True
        self.events: list[tuple[float, bytes]] = []
        self.body = bytearray()
        self.saw_done = False
        self._framing = _Framing.HEAD
        self._rest = b""
        self._left = 0  # bytes left in the current chunk or body; -1: a chunk's CRLF is due
        self._in_trailer = False
        self._line = b""

    @property
    def is_done(self) -> bool:
        return self._framing is _Framing.DONE

    def feed(self, data: bytes, now: float) -> None:
        buf = self._rest + data if self._rest else data
        pos = 0
        if self._framing is _Framing.HEAD:
            head_end = buf.find(b"\r\n\r\n")
            if head_end < 0:
                self._rest = buf
                return
            self._head(buf[:head_end])
            pos = head_end + 4
        framing = self._framing
        if framing is _Framing.CHUNKED:
            pos, body = self._dechunk(buf, pos)
        elif framing is _Framing.LENGTH:
            take = min(self._left, len(buf) - pos)
            body, pos = buf[pos : pos + take], pos + take
            self._left -= take
            if self._left == 0:
                self._framing = _Framing.DONE
        elif framing is _Framing.UNTIL_CLOSE:
            body, pos = buf[pos:], len(buf)
        else:
            body, pos = b"", len(buf)  # bytes after a complete response are dropped
        self._rest = buf[pos:] if pos < len(buf) else b""
        if body:
            self._body(body, now)

    def _dechunk(self, buf: bytes, pos: int) -> tuple[int, bytes]:
        if self._left == 0 and not self._in_trailer and buf.endswith(b"\r\n"):
            fast = self._whole_chunks(buf[pos:] if pos else buf)
            if fast is not None:
                return len(buf), fast
        parts: list[bytes] = []
        end = len(buf)
        left = self._left
        while True:
            if left > 0:
                if pos + left + 2 <= end:  # the common case: the rest of the chunk and its CRLF are here
                    parts.append(buf[pos : pos + left])
                    pos += left + 2
                    left = 0
                else:
                    take = min(left, end - pos)
                    if take == 0:
                        break
                    parts.append(buf[pos : pos + take])
                    pos += take
                    left -= take
                    if left:
                        break
                    left = -1
            if left == -1:
                if end - pos < 2:
                    break
                pos += 2
                left = 0
            nl = buf.find(b"\r\n", pos)
            if nl < 0:
                break
            line, pos = buf[pos:nl], nl + 2
            if self._in_trailer:
                if not line:
                    self._framing = _Framing.DONE
                    break
            elif (size := _chunk_size(line)) == 0:
                self._in_trailer = True
            else:
                left = size
        self._left = left
        return pos, parts[0] if len(parts) == 1 else b"".join(parts)

    def _whole_chunks(self, data: bytes) -> bytes | None:
        """Fast path for a read of whole chunks (what servers write): split on CRLF, check every size
        against its data in C-level maps; None when the read is anything else (the slow path decides)."""
        tokens = data.split(b"\r\n")
        is_last = len(tokens) >= 3 and tokens[-3] == b"0" and tokens[-2] == b""
        if is_last:
            del tokens[-3:]
        else:
            tokens.pop()  # the empty string after the final CRLF
        if len(tokens) % 2:
            return None
        datas = tokens[1::2]
        try:
            if list(map(int, tokens[0::2], repeat(16))) != list(map(len, datas)):
                return None
        except ValueError:  # a chunk extension, or data with a CRLF inside
            return None
        if is_last:
            self._framing = _Framing.DONE
        return b"".join(datas)

    def _head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/"):
            raise ValueError(f"not an HTTP response: {lines[0][:80]!r}")
        self.status = int(parts[1])
        for line in lines[1:]:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        h = self.headers
        self.is_sse = h.get("content-type", "").startswith("text/event-stream")
        self.keep_alive = h.get("connection", "").lower() != "close" and parts[0] != "HTTP/1.0"
        if "chunked" in h.get("transfer-encoding", "").lower():
            self._framing = _Framing.CHUNKED
        elif "content-length" in h:
            self._left = int(h["content-length"])
            self._framing = _Framing.LENGTH if self._left else _Framing.DONE
        elif self.status in (204, 304) or 100 <= self.status < 200:
            self._framing = _Framing.DONE
        else:
            self._framing = _Framing.UNTIL_CLOSE
            self.keep_alive = False

    def _body(self, data: bytes, now: float) -> None:
        if not (self.is_sse and self.status == 200):
            if len(self.body) < _MAX_ERROR_BODY:
                self.body += data
            return
        if self._line:
            data = self._line + data
        lines = data.split(b"\n")
        self._line = lines.pop()  # an unfinished line waits for the next read
        payloads = [line[5:].strip() for line in lines if line.startswith(b"data:")]
        if payloads and payloads[-1] == b"[DONE]":
            payloads.pop()
            self.saw_done = True
        if payloads:
            self.events.extend(zip(repeat(now), payloads))

    def close(self, now: float) -> None:
        """The server closed the connection: a body read until close ends here."""
        if self._framing is _Framing.UNTIL_CLOSE:
            self._body(b"\n", now)
            self._framing = _Framing.DONE
