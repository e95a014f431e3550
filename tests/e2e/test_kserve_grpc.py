"""The KServe v2 gRPC frontend (`--kserve-grpc-port`) on a real `dyn serve` of two mocker workers, driven by
Triton's official client (`tritonclient.grpc`): probes and metadata, ModelInfer and ModelStreamInfer with the same
text as /v1/completions at temperature 0 and one seed (the mocker draws its tokens from it), the API-key gate, and
hostile messages (wrong type, missing input, huge shape, bad bytes) each a gRPC error naming what is wrong while
the server goes on serving."""

from __future__ import annotations

import queue
import re
import struct
from typing import Any

import grpc
import httpx
import numpy as np
import pytest

from tests.conftest import DynProcess, metric_sum, wait_until

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs tritonclient[grpc]")
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

MODEL = "alpha"
PROMPT = "The quick brown fox jumps over the lazy dog"
SEED = 7
GRPC_READY = re.compile(r"kserve grpc (\S+?)\)")


@pytest.fixture(scope="module")
def served(dyn_serve_module) -> DynProcess:  # type: ignore[no-untyped-def]
    d: DynProcess = dyn_serve_module(
        "--engine", "mocker", "--workers", "2", "--served-model-name", MODEL, "--speedup-ratio", "100",
        "--kserve-grpc-port", "0",
    )  # fmt: skip
    assert wait_until(lambda: len(httpx.get(f"{d.url}/health", timeout=10).json().get("instances", [])) == 2, 60)
    return d


def _address(d: DynProcess) -> str:
    match = next(m for line in d.lines if (m := GRPC_READY.search(line)))
    return match.group(1)


@pytest.fixture(scope="module")
def client(served: DynProcess) -> Any:
    c = grpcclient.InferenceServerClient(url=_address(served))
    yield c
    c.close()


@pytest.fixture(scope="module")
def stub(served: DynProcess) -> Any:
    channel = grpc.insecure_channel(_address(served))
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def _headers(d: DynProcess) -> dict[str, str]:
    return {"authorization": f"Bearer {d.key}"}


def _text_input(text: str | bytes) -> Any:
    tensor = grpcclient.InferInput("text_input", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode() if isinstance(text, str) else text], dtype=np.object_))
    return tensor


def _http_text(d: DynProcess, max_tokens: int) -> tuple[str, str]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "seed": SEED}
    reply = httpx.post(f"{d.url}/v1/completions", headers=d.auth, json=body, timeout=30).json()
    return reply["choices"][0]["text"], reply["choices"][0]["finish_reason"]


def test_probes_and_metadata(served: DynProcess, client: Any) -> None:
    assert client.is_server_live() and client.is_server_ready()  # probes: open, as /live and /health
    headers = _headers(served)
    assert client.is_model_ready(MODEL, headers=headers) and not client.is_model_ready("nope", headers=headers)
    meta = client.get_model_metadata(MODEL, headers=headers, as_json=True)
    assert meta["name"] == MODEL and meta["versions"] == ["1"] and meta["platform"] == "dyn"
    assert [(t["name"], t["datatype"]) for t in meta["inputs"]] == [("text_input", "BYTES"), ("streaming", "BOOL")]
    assert [t["name"] for t in meta["outputs"]] == ["text_output", "finish_reason"]
    assert client.get_server_metadata(headers=headers, as_json=True)["name"] == "dyn"
    with pytest.raises(InferenceServerException, match="not served here"):
        client.get_model_metadata("nope", headers=headers)


def test_model_infer_gives_the_completion_text(served: DynProcess, client: Any) -> None:
    expected, reason = _http_text(served, 12)
    result = client.infer(
        MODEL,
        [_text_input(PROMPT)],
        parameters={"max_tokens": 12, "temperature": 0.0, "seed": SEED},
        headers=_headers(served),
    )
    assert result.as_numpy("text_output").tolist() == [expected.encode()] and expected
    assert result.as_numpy("finish_reason").tolist() == [reason.encode()]


def test_sampling_parameters_come_as_tensors_too(served: DynProcess, client: Any) -> None:
    expected, _ = _http_text(served, 5)
    max_tokens = grpcclient.InferInput("max_tokens", [1], "INT32")
    max_tokens.set_data_from_numpy(np.array([5], dtype=np.int32))
    temperature = grpcclient.InferInput("temperature", [1], "FP32")
    temperature.set_data_from_numpy(np.array([0.0], dtype=np.float32))
    seed = grpcclient.InferInput("seed", [1], "INT64")
    seed.set_data_from_numpy(np.array([SEED], dtype=np.int64))
    inputs = [_text_input(PROMPT), max_tokens, temperature, seed]
    outputs = [grpcclient.InferRequestedOutput("text_output")]
    result = client.infer(MODEL, inputs, outputs=outputs, headers=_headers(served))
    assert result.as_numpy("text_output").tolist() == [expected.encode()]
    assert result.as_numpy("finish_reason") is None  # only what was asked for


def _stream(d: DynProcess, requests: list[dict[str, Any]], *, expect: int) -> list[tuple[Any, Any]]:
    """Send `requests` on one ModelStreamInfer stream; the first `expect` (result, error) pairs."""
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url=_address(d))
    client.start_stream(callback=lambda result, error: got.put((result, error)), headers=_headers(d))
    try:
        for request in requests:
            client.async_stream_infer(MODEL, **request)
        return [got.get(timeout=30) for _ in range(expect)]
    finally:
        client.stop_stream()
        client.close()


def _streaming(on: bool) -> Any:
    tensor = grpcclient.InferInput("streaming", [1], "BOOL")
    tensor.set_data_from_numpy(np.array([on], dtype=bool))
    return tensor


def test_model_stream_infer_streams_the_completion_and_ends_with_its_finish_reason(served: DynProcess) -> None:
    expected, reason = _http_text(served, 8)
    request = {
        "inputs": [_text_input(PROMPT), _streaming(True)],
        "request_id": "s-1",
        "parameters": {"max_tokens": 8, "temperature": 0.0, "seed": SEED},
        "enable_empty_final_response": True,
    }
    responses: list[tuple[Any, Any]] = []
    got = _stream_until_final(served, request, responses)
    assert all(error is None for _, error in got)
    assert all(result.get_response().id == "s-1" for result, _ in got)
    pieces = [r.as_numpy("text_output") for r, _ in got if r.as_numpy("text_output") is not None]
    # A worker sends the tokens made while its reader is behind in one frame, so how many pieces come depends on
    # the machine's load; that a stream answers before its end is test_a_stream_the_client_cancels_aborts_its_work's.
    assert b"".join(p[0] for p in pieces).decode() == expected and pieces[-1][0] == b""  # the finish carries no text
    reasons = [r.as_numpy("finish_reason") for r, _ in got if r.as_numpy("finish_reason") is not None]
    assert [x[0] for x in reasons] == [reason.encode()]
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r, _ in got]
    assert finals[-1] and not any(finals[:-1])


def _stream_until_final(d: DynProcess, request: dict[str, Any], responses: list[tuple[Any, Any]]) -> list[Any]:
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url=_address(d))
    client.start_stream(callback=lambda result, error: got.put((result, error)), headers=_headers(d))
    try:
        client.async_stream_infer(MODEL, **request)
        while True:
            result, error = got.get(timeout=30)
            responses.append((result, error))
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                return responses
    finally:
        client.stop_stream()
        client.close()


def test_a_stream_answers_each_request_and_a_bad_one_fails_alone(served: DynProcess) -> None:
    expected, _ = _http_text(served, 4)
    params = {"max_tokens": 4, "temperature": 0.0, "seed": SEED}
    got = _stream(
        served,
        [
            {"inputs": [_text_input(PROMPT)], "request_id": "a", "parameters": params},
            {"inputs": [_text_input(PROMPT)], "request_id": "b", "parameters": {"temperature": -3.0}},
            {"inputs": [_text_input(PROMPT), _streaming(False)], "request_id": "c", "parameters": params},
        ],
        expect=3,
    )
    errors = [str(error) for _, error in got if error is not None]
    assert len(errors) == 1 and "temperature" in errors[0]
    texts = {r.get_response().id: r.as_numpy("text_output")[0].decode() for r, e in got if e is None}
    assert texts == {"a": expected, "c": expected}


def test_without_the_key_inference_is_refused(served: DynProcess, client: Any) -> None:
    with pytest.raises(InferenceServerException) as refused:
        client.infer(MODEL, [_text_input(PROMPT)])
    assert refused.value.status() == "StatusCode.UNAUTHENTICATED" and "Bearer" in refused.value.message()
    with pytest.raises(InferenceServerException, match="UNAUTHENTICATED|key"):
        client.get_model_metadata(MODEL)


def _raw_request(**tensor: Any) -> Any:
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.parameters["max_tokens"].int64_param = 2
    given = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    data = PROMPT.encode()
    raw = struct.pack("<I", len(data)) + data
    for key, value in tensor.items():
        if key == "raw":
            raw = value
        elif key == "shape":
            del given.shape[:]
            given.shape.extend(value)
        else:
            setattr(given, key, value)
    request.raw_input_contents.append(raw)
    return request


@pytest.mark.parametrize(
    ("request_of", "named"),
    [
        (lambda: _raw_request(datatype="INT32", raw=struct.pack("<i", 7)), "text_input"),
        (lambda: _raw_request(shape=[1 << 40]), "text_input"),
        (lambda: _raw_request(shape=[-1]), "text_input"),
        (lambda: _raw_request(raw=b"\xff\xff\xff\x7fabc"), "text_input"),
        (lambda: _raw_request(raw=b"\x03\x00\x00\x00\xff\xfe\xfd"), "UTF-8"),
        (lambda: _raw_request(name="txt"), "txt"),
        (lambda: service_pb2.ModelInferRequest(model_name=MODEL), "text_input"),
        (lambda: _with_parameter("temperature", "string_param", "hot"), "temperature"),
        (lambda: _with_parameter("top_q", "double_param", 0.5), "top_q"),
        (lambda: _with_parameter("max_tokens", "int64_param", -5), "max_tokens"),
        (lambda: _with_version("7"), "model_version"),
    ],
)
def test_a_bad_tensor_is_invalid_argument_naming_it(served: DynProcess, stub: Any, request_of: Any, named: str) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(request_of(), metadata=tuple(_headers(served).items()), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert named in refused.value.details()


def _with_version(version: str) -> Any:
    request = _raw_request()
    request.model_version = version
    return request


def _with_parameter(name: str, kind: str, value: Any) -> Any:
    request = _raw_request()
    setattr(request.parameters[name], kind, value)
    return request


def test_bytes_that_are_no_message_and_unknown_models_are_clean_errors(served: DynProcess, client: Any) -> None:
    channel = grpc.insecure_channel(_address(served))
    try:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as refused:
            call(b"\xff\xff\xff\xff\x0f", metadata=tuple(_headers(served).items()), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        unknown = channel.unary_unary("/inference.GRPCInferenceService/ModelConfig")
        with pytest.raises(grpc.RpcError) as unimplemented:
            unknown(b"", timeout=30)
        assert unimplemented.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        channel.close()
    with pytest.raises(InferenceServerException) as missing:
        client.infer("nope", [_text_input(PROMPT)], headers=_headers(served))
    assert missing.value.status() == "StatusCode.NOT_FOUND" and "nope" in missing.value.message()
    assert client.infer(MODEL, [_text_input(PROMPT)], parameters={"max_tokens": 2}, headers=_headers(served))


def test_kserve_requests_are_counted_in_the_metrics(served: DynProcess, client: Any) -> None:
    client.infer(MODEL, [_text_input(PROMPT)], parameters={"max_tokens": 2}, headers=_headers(served))
    text = httpx.get(f"{served.url}/metrics", headers=served.auth, timeout=10).text
    assert any(
        line.startswith("dynamo_frontend_requests_total{") and '"kserve_infer"' in line and 'status="success"' in line
        for line in text.splitlines()
    )


def _metric(d: DynProcess, prefix: str) -> float:
    return metric_sum(d.url, prefix, d.auth)


def test_a_stream_the_client_cancels_aborts_its_work(served: DynProcess) -> None:
    cancelled_before = _metric(served, "dynamo_frontend_model_cancellation_total{")
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(url=_address(served))
    client.start_stream(callback=lambda result, error: got.put((result, error)), headers=_headers(served))
    inputs = [_text_input(PROMPT), _streaming(True)]
    client.async_stream_infer(MODEL, inputs, request_id="long", parameters={"max_tokens": 5000, "ignore_eos": True})
    assert got.get(timeout=30)[1] is None  # generating
    client.stop_stream(cancel_requests=True)
    client.close()
    assert wait_until(lambda: _metric(served, "dynamo_frontend_inflight_requests{") == 0, timeout=20)
    assert _metric(served, "dynamo_frontend_model_cancellation_total{") == cancelled_before + 1


def test_tls_and_its_ca_as_on_https(dyn_serve, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.planes import make_tls_files

    ca, cert, key = make_tls_files(tmp_path)
    d: DynProcess = dyn_serve(
        "--engine", "mocker", "--served-model-name", MODEL, "--speedup-ratio", "100", "--kserve-grpc-port", "0",
        "--tls-cert-file", str(cert), "--tls-key-file", str(key),
    )  # fmt: skip
    secure = grpcclient.InferenceServerClient(url=_address(d), ssl=True, root_certificates=str(ca))
    try:
        assert wait_until(lambda: secure.is_server_ready(), timeout=60)
        result = secure.infer(MODEL, [_text_input(PROMPT)], parameters={"max_tokens": 3}, headers=_headers(d))
        assert result.as_numpy("finish_reason").tolist() == [b"length"]
    finally:
        secure.close()
    plain = grpcclient.InferenceServerClient(url=_address(d))
    try:
        with pytest.raises(InferenceServerException):
            plain.is_server_live(client_timeout=5)
    finally:
        plain.close()
