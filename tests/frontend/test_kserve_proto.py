"""The KServe messages `dyn` builds at run time (frontend/kserve/proto.py) against the ones Triton's client was
generated from (tritonclient.grpc.service_pb2): every field's name, number, type and label, and the RPCs; then
the request reader (kserve/tensors.py) on messages the client's own classes wrote."""

from __future__ import annotations

import struct

import pytest

from dynamo_cli.errors import RequestError
from dynamo_cli.frontend.kserve import proto
from dynamo_cli.frontend.kserve.tensors import OUTPUTS, infer_response, read_request

service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2", reason="needs tritonclient[grpc]")


def _fields(descriptor) -> list[tuple[object, ...]]:  # type: ignore[no-untyped-def]
    return sorted(
        (
            f.name,
            f.number,
            f.type,
            f.label,
            f.message_type.full_name if f.message_type is not None else None,
            f.containing_oneof.name if f.containing_oneof is not None else None,
        )
        for f in descriptor.fields
    )


@pytest.mark.parametrize("name", list(proto.MESSAGES))
def test_each_message_has_the_published_fields(name: str) -> None:
    theirs = service_pb2.DESCRIPTOR.message_types_by_name[name.split(".")[0]]
    for nested in name.split(".")[1:]:
        theirs = theirs.nested_types_by_name[nested]
    assert _fields(proto.descriptor(name)) == _fields(theirs)


def test_the_rpcs_are_the_published_ones() -> None:
    theirs = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert theirs.full_name == proto.SERVICE
    for rpc, (request, response, streaming) in proto.RPCS.items():
        method = theirs.methods_by_name[rpc]
        assert (method.input_type.name, method.output_type.name) == (request, response)
        assert method.input_type.full_name == f"inference.{request}"
        assert (method.client_streaming, method.server_streaming) == (streaming, streaming)


def _request(**parameters: object) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="m", id="r-1")
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(struct.pack("<I", 2) + b"hi")
    for key, value in parameters.items():
        kind = {bool: "bool_param", int: "int64_param", float: "double_param", str: "string_param"}[type(value)]
        setattr(request.parameters[key], kind, value)
    return request


def test_a_request_becomes_the_completion_it_asks() -> None:
    call = read_request(_request(max_tokens=5, temperature=1, stop="\n").SerializeToString())
    assert call.completion == {"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 1.0, "stop": "\n"}
    assert (call.id, call.outputs, call.empty_final) == ("r-1", OUTPUTS, False)


def test_contents_serve_as_well_as_raw_bytes() -> None:
    request = service_pb2.ModelInferRequest(model_name="m")
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1, 1]).contents.bytes_contents.append(b"yo")
    request.inputs.add(name="streaming", datatype="BOOL", shape=[1]).contents.bool_contents.append(True)
    request.inputs.add(name="max_tokens", datatype="UINT32", shape=[1]).contents.uint_contents.append(3)
    call = read_request(request.SerializeToString())
    assert call.completion == {"model": "m", "prompt": "yo", "stream": True, "max_tokens": 3}


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda r: r.raw_input_contents.append(b"x"), "inputs"),
        (lambda r: (r.inputs.add(name="text_input"), r.raw_input_contents.append(b"")), "text_input"),
        (lambda r: r.outputs.add(name="logits"), "logits"),
        (lambda r: r.parameters["bogus"].bool_param, "bogus"),
        (lambda r: setattr(r.parameters["ignore_eos"], "int64_param", 1), "ignore_eos"),
    ],
)
def test_each_bad_part_is_named(edit, named: str) -> None:  # type: ignore[no-untyped-def]
    request = _request()
    edit(request)
    with pytest.raises(RequestError) as refused:
        read_request(request.SerializeToString())
    assert refused.value.param == named


def test_the_response_reads_back_with_the_clients_classes() -> None:
    call = read_request(_request().SerializeToString())
    theirs = service_pb2.ModelInferResponse.FromString(infer_response(call, "héllo", "stop").SerializeToString())
    assert [o.name for o in theirs.outputs] == ["text_output", "finish_reason"] and theirs.id == "r-1"
    assert list(theirs.raw_output_contents) == [struct.pack("<I", 6) + "héllo".encode(), b"\x04\x00\x00\x00stop"]
