"""A tiny OpenAI-style streaming server with a known rhythm, for the bench tests and the client benchmark.

It speaks just enough HTTP/1.1 (keep-alive, chunked SSE) to stand in for a real frontend: GET /v1/models,
and POST /v1/chat/completions or /v1/completions streaming `max_tokens` tokens, the first after
`ttft_s` (or `ttft_schedule[i]` for the i-th request) and then one every `gap_s`.

Run it alone (`python tests/bench/sse_server.py [--ttft-ms 0 --gap-ms 0]`): it prints `READY host:port`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
from dataclasses import dataclass, field

MODEL = "test-model"


@dataclass
class Rhythm:
    ttft_s: float = 0.05
    gap_s: float = 0.01
    ttft_schedule: list[float] | None = None  # per request, cycled; overrides ttft_s
    tokens_per_chunk: int = 1
    send_usage: bool = True
    fail_every: int = 0  # every n-th request answers HTTP 500
    not_sse: bool = False  # answer plain JSON instead of an SSE stream
    models: tuple[str, ...] = (MODEL,)  # what GET /v1/models lists and POSTs may name
    arrivals: list[float] = field(default_factory=list)  # perf_counter() of every POST
    bodies: list[dict] = field(default_factory=list)
    writers: set[asyncio.StreamWriter] = field(default_factory=set)  # open connections, closed by stop()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(doc: dict) -> bytes:
    return _chunk(b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n")


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        if line.lower().startswith("content-length:"):
            length = int(line.split(":", 1)[1])
    body = await reader.readexactly(length) if length else b""
    return method, path, body


def _json_response(status: int, doc: object) -> bytes:
    body = json.dumps(doc).encode()
    reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error"}[status]
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _stream(writer: asyncio.StreamWriter, rhythm: Rhythm, body: dict, index: int, is_chat: bool) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    if is_chat:
        writer.write(_event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
    n = int(body.get("max_tokens", 16))
    schedule = rhythm.ttft_schedule
    ttft = schedule[index % len(schedule)] if schedule else rhythm.ttft_s
    start = time.perf_counter()
    sent = 0
    while sent < n:
        at = start + ttft + rhythm.gap_s * (sent // rhythm.tokens_per_chunk)
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        k = min(rhythm.tokens_per_chunk, n - sent)
        text = " tok" * k
        choice = {"index": 0, "delta": {"content": text}} if is_chat else {"index": 0, "text": text}
        writer.write(_event({"choices": [choice]}))
        sent += k
        if rhythm.gap_s > 0:
            await writer.drain()
    if rhythm.send_usage:
        writer.write(_event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}}))
    writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await writer.drain()


async def _handle(rhythm: Rhythm, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    rhythm.writers.add(writer)
    sock = writer.get_extra_info("socket")
    if sock is not None:  # as real servers do; Nagle + delayed ACK would add 40 ms to small SSE writes
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while (request := await _read_request(reader)) is not None:
            method, path, raw = request
            if method == "GET" and path == "/v1/models":
                listed = [{"id": model, "object": "model"} for model in rhythm.models]
                writer.write(_json_response(200, {"object": "list", "data": listed}))
                continue
            rhythm.arrivals.append(time.perf_counter())
            index = len(rhythm.arrivals) - 1
            body = json.loads(raw)
            rhythm.bodies.append(body)
            if body.get("model") not in rhythm.models:
                writer.write(_json_response(404, {"error": {"message": f"model {body.get('model')} not found"}}))
            elif rhythm.fail_every and (index + 1) % rhythm.fail_every == 0:
                writer.write(_json_response(500, {"error": {"message": "injected failure"}}))
            elif rhythm.not_sse:
                writer.write(_json_response(200, {"choices": [{"message": {"content": "hi"}}]}))
            else:
                await _stream(writer, rhythm, body, index, path.endswith("/chat/completions"))
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        rhythm.writers.discard(writer)
        writer.close()


async def start(rhythm: Rhythm) -> tuple[asyncio.Server, str]:
    """Serve on 127.0.0.1 on a pre-bound port-0 socket; return the server and its base URL."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    server = await asyncio.start_server(lambda r, w: _handle(rhythm, r, w), sock=sock)
    host, port = sock.getsockname()[:2]
    return server, f"http://{host}:{port}"


async def stop(server: asyncio.Server, rhythm: Rhythm) -> None:
    """Stop listening and close every open connection."""
    server.close()
    for writer in list(rhythm.writers):
        writer.close()
    await server.wait_closed()
    for _ in range(3):
        await asyncio.sleep(0)


async def _main(args: argparse.Namespace) -> None:
    rhythm = Rhythm(ttft_s=args.ttft_ms / 1e3, gap_s=args.gap_ms / 1e3, tokens_per_chunk=args.tokens_per_chunk)
    server, url = await start(rhythm)
    print(f"READY {url.removeprefix('http://')}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--gap-ms", type=float, default=0.0)
    parser.add_argument("--tokens-per-chunk", type=int, default=1)
    try:
        import uvloop

        uvloop.run(_main(parser.parse_args()))
    except ImportError:
        asyncio.run(_main(parser.parse_args()))
    except KeyboardInterrupt:
        pass
