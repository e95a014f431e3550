"""The lean client: HTTP framing and SSE parsed by hand, keep-alive reuse, failures as records."""

from __future__ import annotations

import asyncio

import pytest
from sse_server import Rhythm

from dynamo_cli.bench.http import EndpointUnreachable, HttpClient, RequestRecord, fill_from_events
from dynamo_cli.bench.sse import Response as _Response

EVENTS = [
    b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n',
    b'data: {"choices":[{"delta":{"content":"A"}}]}\n\n',
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n',
    b"data: [DONE]\n\n",
]
CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS)
    + b"0\r\n\r\n"
)


@pytest.mark.parametrize("step", [1, 2, 7, 64, len(CHUNKED)], ids=lambda s: f"feed-{s}-bytes")
def test_a_chunked_sse_response_parses_the_same_however_the_bytes_are_split(step: int) -> None:
    response = _Response()
    for i in range(0, len(CHUNKED), step):
        response.feed(CHUNKED[i : i + step], float(i))
    assert response.is_done and response.saw_done and response.status == 200 and response.keep_alive
    record = RequestRecord()
    fill_from_events(record, response.events)
    assert record.pieces == ["A"]
    assert (record.prompt_tokens, record.completion_tokens) == (3, 1)
    assert len(response.events) == 3  # role chunk, content chunk, usage chunk; [DONE] is not an event


def test_sse_events_with_crlf_line_endings_take_the_slow_path_and_parse_the_same() -> None:
    crlf = [e.replace(b"\n", b"\r\n") for e in EVENTS]
    raw = CHUNKED.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n"
    raw += b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in crlf) + b"0\r\n\r\n"
    response = _Response()
    response.feed(raw, 1.0)
    assert response.is_done and response.saw_done
    assert [p for _, p in response.events] == [e[6:].strip() for e in EVENTS[:3]]


def test_a_content_length_error_body_is_kept_for_the_message() -> None:
    response = _Response()
    body = b'{"error":{"message":"model x not found"}}'
    response.feed(b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n" % len(body) + body, 0.0)
    assert response.is_done and response.status == 404 and bytes(response.body) == body


async def test_the_client_reuses_one_connection_per_slot_across_requests(serve) -> None:
    rhythm = Rhythm(ttft_s=0.0, gap_s=0.0)
    async with serve(rhythm) as url, HttpClient(url, max_connections=2) as client:
        records = await asyncio.gather(
            *(client.stream_chat({"model": "test-model", "max_tokens": 3}) for _ in range(6))
        )
        assert [r.error for r in records] == [None] * 6
        assert all(r.text == " tok tok tok" and r.completion_tokens == 3 for r in records)
        assert len(rhythm.writers) == 2  # two keep-alive connections served all six requests


async def test_a_wrong_model_becomes_a_failed_record_with_the_servers_message(serve) -> None:
    async with serve(Rhythm()) as url, HttpClient(url) as client:
        record = await client.stream_chat({"model": "nope", "max_tokens": 3})
    assert record.status == 404 and record.error == "HTTP 404: model nope not found"


async def test_a_server_that_does_not_stream_sse_is_a_failed_record(serve) -> None:
    async with serve(Rhythm(not_sse=True)) as url, HttpClient(url) as client:
        record = await client.stream_chat({"model": "test-model", "max_tokens": 3})
    assert record.error is not None and record.error.startswith("not an SSE stream")


async def test_an_idle_stream_times_out_instead_of_hanging(serve) -> None:
    async with serve(Rhythm(ttft_s=2.0)) as url, HttpClient(url, idle_timeout=0.2) as client:
        record = await client.stream_chat({"model": "test-model", "max_tokens": 3})
    assert record.error == "no bytes for 0.2 s (idle timeout)"


async def test_an_unreachable_url_raises_endpoint_unreachable_from_get_json() -> None:
    async with HttpClient("http://127.0.0.1:1", connect_timeout=2) as client:
        with pytest.raises(EndpointUnreachable, match="cannot reach http://127.0.0.1:1"):
            await client.get_json("/v1/models")
