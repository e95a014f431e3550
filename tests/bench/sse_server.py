"""A tiny OpenAI-style streaming server with a known rhythm, for the bench tests and the client benchmark.

It speaks just enough HTTP/1.1 (keep-alive, chunked SSE) to stand in for a real frontend: GET /v1/models,
and POST /v1/chat/completions or /v1/completions streaming `max_tokens` tokens, the first after
`ttft_s` (or `ttft_schedule[i]` for the i-th request) and then one every `gap_s`. With `prefix_cache`, usage
counts the prompt's words and, as cached, the longest word prefix it shares with an earlier prompt; a tenant
named in `reject_tenant` is answered 429 with `Retry-After`.

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
    reject_tenant: str | None = None  # POSTs with this x-dyn-tenant are answered 429 with `retry_after`
    retry_after: str = "3"
    prefix_cache: bool = False  # usage counts the prompt's words, and as cached its longest prefix seen before
    arrivals: list[float] = field(default_factory=list)  # perf_counter() of every POST
    ends: list[float] = field(default_factory=list)  # perf_counter() when each POST's answer was written
    bodies: list[dict] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)  # of every POST, names lowercased
    prompts: list[list[str]] = field(default_factory=list)  # every POST's prompt words (the prefix cache's)
    writers: set[asyncio.StreamWriter] = field(default_factory=set)  # open connections, closed by stop()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(doc: dict) -> bytes:
    return _chunk(b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n")


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], bytes] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", 0))
    body = await reader.readexactly(length) if length else b""
    return method, path, headers, body


def _json_response(status: int, doc: object, extra: str = "") -> bytes:
    body = json.dumps(doc).encode()
    reason = {200: "OK", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error"}[status]
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n{extra}Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def prompt_words(body: dict) -> list[str]:
    """The words of a request's prompt: its messages' contents, or its completion prompt."""
    if "prompt" in body:
        return body["prompt"].split()
    return [word for message in body.get("messages", []) for word in str(message["content"]).split()]


def _usage(rhythm: Rhythm, body: dict, n: int) -> dict:
    if not rhythm.prefix_cache:
        return {"prompt_tokens": 7, "completion_tokens": n}
    words = prompt_words(body)
    cached = 0
    for seen in rhythm.prompts:
        common = next(
            (i for i, (a, b) in enumerate(zip(words, seen, strict=False)) if a != b), min(len(words), len(seen))
        )
        cached = max(cached, common)
    rhythm.prompts.append(words)
    details = {"cached_tokens": cached}
    return {"prompt_tokens": len(words), "completion_tokens": n, "prompt_tokens_details": details}


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
        writer.write(_event({"choices": [], "usage": _usage(rhythm, body, n)}))
    writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await writer.drain()


async def _handle(rhythm: Rhythm, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    rhythm.writers.add(writer)
    sock = writer.get_extra_info("socket")
    if sock is not None:  # as real servers do; Nagle + delayed ACK would add 40 ms to small SSE writes
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while (request := await _read_request(reader)) is not None:
            method, path, headers, raw = request
            if method == "GET" and path == "/v1/models":
                listed = [{"id": model, "object": "model"} for model in rhythm.models]
                writer.write(_json_response(200, {"object": "list", "data": listed}))
                continue
            rhythm.arrivals.append(time.perf_counter())
            index = len(rhythm.arrivals) - 1
            body = json.loads(raw)
            rhythm.bodies.append(body)
            rhythm.headers.append(headers)
            if rhythm.reject_tenant and headers.get("x-dyn-tenant") == rhythm.reject_tenant:
                doc = {"error": {"message": "tenant over its limit"}}
                writer.write(_json_response(429, doc, f"Retry-After: {rhythm.retry_after}\r\n"))
            elif body.get("model") not in rhythm.models:
                writer.write(_json_response(404, {"error": {"message": f"model {body.get('model')} not found"}}))
            elif rhythm.fail_every and (index + 1) % rhythm.fail_every == 0:
                writer.write(_json_response(500, {"error": {"message": "injected failure"}}))
            elif rhythm.not_sse:
                writer.write(_json_response(200, {"choices": [{"message": {"content": "hi"}}]}))
            else:
                await _stream(writer, rhythm, body, index, path.endswith("/chat/completions"))
            await writer.drain()
            rhythm.ends.append(time.perf_counter())
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
