"""One trace per request across processes: `dyn serve --disagg` exports its spans with OTLP/HTTP to a loopback
receiver that decodes the protobuf as a collector would; the client's `traceparent` is continued, the trace
follows the prefill hop and a migration, and the JSON log lines of a request carry its trace id."""

from __future__ import annotations

import json
import os
import secrets
import signal
from collections.abc import Iterator

import openai
import pytest

from tests.conftest import DynProcess
from tests.otlp import OtlpReceiver, ReceivedSpan, serve_otlp

MOCKER = ("--engine", "mocker", "--speedup-ratio", "1", "--lease-ttl", "2", "--router", "kv")
CLIENT_SPAN = "00f067aa0ba902b7"
"""The client's own span: the frontend's request span is its child."""
MESSAGES = [{"role": "user", "content": "tell me a story " * 20}]


def traceparent(trace_id: str, *, sampled: bool = True) -> str:
    return f"00-{trace_id}-{CLIENT_SPAN}-{'01' if sampled else '00'}"


def client_of(d: DynProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key=d.api_key, max_retries=0, timeout=60)


def one(spans: list[ReceivedSpan], name: str, service: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name and s.service == service]
    assert len(found) == 1, (name, service, [(s.name, s.service) for s in spans])
    return found[0]


def has(*wanted: tuple[str, str]):  # type: ignore[no-untyped-def]
    """A `wait_for` predicate: spans of these (name, service) pairs have all arrived."""
    return lambda spans: set(wanted) <= {(s.name, s.service) for s in spans}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with serve_otlp() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def disagg(dyn_serve_module, receiver: OtlpReceiver) -> DynProcess:  # type: ignore[no-untyped-def]
    """1 prefill + 2 decode workers, every prompt prefilled remotely, JSON logs, traced to `receiver`."""
    flags = ("--disagg", "--disagg-policy", "always", "--decode-workers", "2", "--log-format", "json")
    return dyn_serve_module(*MOCKER, *flags, "--otlp-endpoint", receiver.url)  # type: ignore[no-any-return]


def test_a_disaggregated_request_is_one_trace_across_the_frontend_and_both_workers(
    disagg: DynProcess, receiver: OtlpReceiver
) -> None:
    trace_id = secrets.token_hex(16)
    raw = client_of(disagg).chat.completions.with_raw_response.create(
        model="smollm2",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=8,
        extra_body={"ignore_eos": True},
        extra_headers={"traceparent": traceparent(trace_id)},
    )
    completion = raw.parse()
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    assert raw.headers["x-dyn-trace-id"] == trace_id
    spans = receiver.wait_for(
        trace_id,
        has(
            ("worker.generate", "dyn-worker-prefill"),
            ("worker.generate", "dyn-worker-decode"),
            ("kv.pull", "dyn-worker-decode"),
            ("http.request", "dyn-frontend"),
        ),
    )

    request = one(spans, "http.request", "dyn-frontend")
    assert request.parent_span_id == CLIENT_SPAN  # the client's trace, continued
    assert request.attributes["gen_ai.request.model"] == "smollm2"
    assert request.attributes["http.response.status_code"] == 200
    assert request.attributes["dyn.request_id"] == completion.id
    tokenize, route, prefill = (one(spans, name, "dyn-frontend") for name in ("tokenize", "route", "prefill"))
    assert {tokenize.parent_span_id, route.parent_span_id, prefill.parent_span_id} == {request.span_id}
    assert tokenize.attributes["gen_ai.usage.input_tokens"] == completion.usage.prompt_tokens
    assert route.attributes["dyn.worker_id"] == raw.headers["x-worker-instance-id"]  # the decode worker
    assert isinstance(route.attributes["dyn.route.overlap_blocks"], int) and "dyn.route.cost" in route.attributes
    assert prefill.attributes["dyn.prefill.worker_id"] == raw.headers["x-dyn-prefill-instance-id"]

    prefilled = one(spans, "worker.generate", "dyn-worker-prefill")
    decoded = one(spans, "worker.generate", "dyn-worker-decode")
    assert prefilled.parent_span_id == prefill.span_id  # each worker's span is a child of a frontend span
    assert decoded.parent_span_id == request.span_id
    assert prefilled.pid in disagg.worker_pids("prefill") and decoded.pid in disagg.worker_pids("decode")
    assert prefilled.attributes["dyn.worker_id"] == raw.headers["x-dyn-prefill-instance-id"]
    assert decoded.attributes["dyn.worker_id"] == raw.headers["x-worker-instance-id"]
    assert decoded.attributes["gen_ai.usage.output_tokens"] == 7  # the prefill worker sampled the first
    assert decoded.attributes["gen_ai.response.finish_reasons"] == ["length"] and "first_token" in decoded.events
    pulled = one(spans, "kv.pull", "dyn-worker-decode")
    assert pulled.parent_span_id == decoded.span_id and pulled.attributes["dyn.kv.backend"] == "tcp"
    assert not any(s.is_error for s in spans)


def test_a_malformed_traceparent_starts_a_new_trace_and_fails_nothing(disagg: DynProcess) -> None:
    raw = client_of(disagg).chat.completions.with_raw_response.create(
        model="smollm2",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=2,
        extra_headers={"traceparent": "00-" + "0" * 32 + "-" + CLIENT_SPAN + "-01"},  # an all-zero trace id
    )
    trace_id = raw.headers["x-dyn-trace-id"]
    assert raw.http_response.status_code == 200 and len(trace_id) == 32 and trace_id != "0" * 32


def test_a_migrated_stream_names_both_decode_workers_in_one_trace(disagg: DynProcess, receiver: OtlpReceiver) -> None:
    """Last in this module: it kills a decode worker (`dyn serve` starts another)."""
    trace_id = secrets.token_hex(16)
    with client_of(disagg).chat.completions.with_streaming_response.create(
        model="smollm2",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=200,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        extra_headers={"traceparent": traceparent(trace_id)},
    ) as response:
        victim = response.headers["x-worker-instance-id"]
        pid = next(r.pid for r in disagg.instance_records() if f"{r.instance_id:x}" == victim)
        num_pieces, usage = 0, None
        for chunk in response.parse():
            num_pieces += bool(chunk.choices and chunk.choices[0].delta.content)
            if num_pieces == 10:
                os.kill(pid, signal.SIGKILL)
            usage = chunk.usage or usage
    assert usage is not None and usage.completion_tokens == 200

    def migrated(spans: list[ReceivedSpan]) -> bool:
        # the survivor's own generate span (the victim's kv.pull names no worker: it must not count)
        decoders = {
            s.attributes.get("dyn.worker_id")
            for s in spans
            if s.service == "dyn-worker-decode" and s.name == "worker.generate"
        }
        return any(s.name == "http.request" for s in spans) and bool(decoders - {victim, None})

    spans = receiver.wait_for(trace_id, migrated)
    request = one(spans, "http.request", "dyn-frontend")
    migration = request.events["migration"]
    assert migration["dyn.migration.from_worker_id"] == victim and migration["dyn.migration.attempt"] == 1
    survivor = migration["dyn.migration.to_worker_id"]
    assert survivor != victim and migration["dyn.migration.reason"]
    taken_on = one(spans, "worker.generate", "dyn-worker-decode")  # the killed worker's span died with it
    assert taken_on.attributes["dyn.worker_id"] == survivor and taken_on.pid != pid
    assert taken_on.parent_span_id == request.span_id

    # the frontend's JSON log line about it names the request and its trace
    logged = [json.loads(line) for line in disagg.lines if line.startswith("{") and "migrating" in line]
    assert [(e["level"], e["logger"], e["trace_id"], e["request_id"]) for e in logged] == [
        ("WARNING", "dynamo_cli.core.dispatch", trace_id, request.attributes["dyn.request_id"])
    ]


def test_behind_dyn_router_the_trace_runs_from_the_frontend_through_the_router_to_both_workers(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    trace_id = secrets.token_hex(16)
    with serve_otlp() as receiver:
        flags = ("--disagg", "--disagg-policy", "always", "--router", "remote", "--routers", "1")
        d = dyn_serve("--engine", "mocker", "--speedup-ratio", "10", *flags, "--otlp-endpoint", receiver.url)
        raw = client_of(d).chat.completions.with_raw_response.create(
            model="smollm2",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=4,
            extra_headers={"traceparent": traceparent(trace_id)},
        )
        wanted = [("router.generate", "dyn-router"), ("http.request", "dyn-frontend")]
        wanted += [("worker.generate", "dyn-worker-prefill"), ("worker.generate", "dyn-worker-decode")]
        spans = receiver.wait_for(trace_id, has(*wanted))
    request, routed = one(spans, "http.request", "dyn-frontend"), one(spans, "router.generate", "dyn-router")
    assert one(spans, "route", "dyn-frontend").attributes["dyn.router_id"] == raw.headers["x-dyn-router-instance-id"]
    assert routed.parent_span_id == request.span_id and routed.attributes["dyn.status"] == "success"
    route, prefill = one(spans, "route", "dyn-router"), one(spans, "prefill", "dyn-router")  # the router routes
    assert route.parent_span_id == prefill.parent_span_id == routed.span_id
    assert route.attributes["dyn.worker_id"] == raw.headers["x-worker-instance-id"]
    assert one(spans, "worker.generate", "dyn-worker-prefill").parent_span_id == prefill.span_id
    assert one(spans, "worker.generate", "dyn-worker-decode").parent_span_id == routed.span_id


def test_at_ratio_0_only_a_trace_the_client_sampled_is_exported(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    with serve_otlp() as receiver:
        flags = ("--otlp-endpoint", receiver.url, "--trace-sample-ratio", "0")
        d = dyn_serve("--engine", "mocker", "--speedup-ratio", "10", *flags)
        sampled = _ask_at_ratio_0(d)
        assert d.stop() == 0  # SIGTERM: every process exports what it still holds
        exported = list(receiver.spans)
    assert {s.trace_id for s in exported} == {sampled}
    assert {s.service for s in exported} == {"dyn-frontend", "dyn-worker-both"}


def _ask_at_ratio_0(d: DynProcess) -> str:
    """Requests with no traceparent, with an unsampled one and with a sampled one: the trace id of the last."""
    client, sampled, unsampled = client_of(d), secrets.token_hex(16), secrets.token_hex(16)

    def ask(headers: dict[str, str]) -> str | None:
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=2,
            extra_headers=headers,
        )
        assert raw.http_response.status_code == 200
        return raw.headers.get("x-dyn-trace-id")

    assert ask({}) is None  # a new trace at ratio 0: not sampled, not named
    assert ask({"traceparent": traceparent(unsampled, sampled=False)}) is None
    assert ask({"traceparent": traceparent(sampled)}) == sampled  # the client's sampled flag decides
    return sampled
