"""The messages of the KServe v2 / Triton inference protocol that `dyn` serves, built at import into a private
descriptor pool from the table below: the field names and numbers of the published `grpc_service.proto`
(package `inference`, triton-inference-server/common), so Triton's clients read and write them unchanged.

No generated `_pb2` code: generated code pins the protobuf runtime it runs on, and this table works on any
protobuf 5 to 7. tests/frontend/test_kserve_proto.py checks every field against the client's own descriptors.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "inference"
SERVICE = f"{PACKAGE}.GRPCInferenceService"

_SCALARS = {
    "bool": descriptor_pb2.FieldDescriptorProto.TYPE_BOOL,
    "string": descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
    "bytes": descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
    "int32": descriptor_pb2.FieldDescriptorProto.TYPE_INT32,
    "int64": descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
    "uint32": descriptor_pb2.FieldDescriptorProto.TYPE_UINT32,
    "uint64": descriptor_pb2.FieldDescriptorProto.TYPE_UINT64,
    "float": descriptor_pb2.FieldDescriptorProto.TYPE_FLOAT,
    "double": descriptor_pb2.FieldDescriptorProto.TYPE_DOUBLE,
}
_TENSOR = [("name", 1, "string"), ("datatype", 2, "string"), ("shape", 3, "*int64")]
_INFER = [("model_name", 1, "string"), ("model_version", 2, "string"), ("id", 3, "string"), ("parameters", 4, "map")]
"""The fields a ModelInferRequest and its response share."""

MESSAGES: dict[str, list[tuple[str, int, str]]] = {
    # name -> its fields (name, number, type): `*T` repeated, `map` a map<string, InferParameter>, `|T` a member of
    # the message's one oneof, any other name a message; `A.B` is B nested in A.
    "ServerLiveRequest": [],
    "ServerLiveResponse": [("live", 1, "bool")],
    "ServerReadyRequest": [],
    "ServerReadyResponse": [("ready", 1, "bool")],
    "ModelReadyRequest": [("name", 1, "string"), ("version", 2, "string")],
    "ModelReadyResponse": [("ready", 1, "bool")],
    "ServerMetadataRequest": [],
    "ServerMetadataResponse": [("name", 1, "string"), ("version", 2, "string"), ("extensions", 3, "*string")],
    "ModelMetadataRequest": [("name", 1, "string"), ("version", 2, "string")],
    "ModelMetadataResponse": [
        ("name", 1, "string"),
        ("versions", 2, "*string"),
        ("platform", 3, "string"),
        ("inputs", 4, "*ModelMetadataResponse.TensorMetadata"),
        ("outputs", 5, "*ModelMetadataResponse.TensorMetadata"),
    ],
    "ModelMetadataResponse.TensorMetadata": _TENSOR,
    "InferParameter": [
        ("bool_param", 1, "|bool"),
        ("int64_param", 2, "|int64"),
        ("string_param", 3, "|string"),
        ("double_param", 4, "|double"),
        ("uint64_param", 5, "|uint64"),
    ],
    "InferTensorContents": [
        ("bool_contents", 1, "*bool"),
        ("int_contents", 2, "*int32"),
        ("int64_contents", 3, "*int64"),
        ("uint_contents", 4, "*uint32"),
        ("uint64_contents", 5, "*uint64"),
        ("fp32_contents", 6, "*float"),
        ("fp64_contents", 7, "*double"),
        ("bytes_contents", 8, "*bytes"),
    ],
    "ModelInferRequest": [
        *_INFER,
        ("inputs", 5, "*ModelInferRequest.InferInputTensor"),
        ("outputs", 6, "*ModelInferRequest.InferRequestedOutputTensor"),
        ("raw_input_contents", 7, "*bytes"),
    ],
    "ModelInferRequest.InferInputTensor": [*_TENSOR, ("parameters", 4, "map"), ("contents", 5, "InferTensorContents")],
    "ModelInferRequest.InferRequestedOutputTensor": [("name", 1, "string"), ("parameters", 2, "map")],
    "ModelInferResponse": [
        *_INFER,
        ("outputs", 5, "*ModelInferResponse.InferOutputTensor"),
        ("raw_output_contents", 6, "*bytes"),
    ],
    "ModelInferResponse.InferOutputTensor": [
        *_TENSOR,
        ("parameters", 4, "map"),
        ("contents", 5, "InferTensorContents"),
    ],
    "ModelStreamInferResponse": [("error_message", 1, "string"), ("infer_response", 2, "ModelInferResponse")],
}

RPCS: dict[str, tuple[str, str, bool]] = {
    "ServerLive": ("ServerLiveRequest", "ServerLiveResponse", False),
    "ServerReady": ("ServerReadyRequest", "ServerReadyResponse", False),
    "ModelReady": ("ModelReadyRequest", "ModelReadyResponse", False),
    "ServerMetadata": ("ServerMetadataRequest", "ServerMetadataResponse", False),
    "ModelMetadata": ("ModelMetadataRequest", "ModelMetadataResponse", False),
    "ModelInfer": ("ModelInferRequest", "ModelInferResponse", False),
    "ModelStreamInfer": ("ModelInferRequest", "ModelStreamInferResponse", True),
}
"""The RPCs served: name -> (request, response, streaming both ways). The others of the service (model
repository, shared memory, statistics, ModelConfig) answer UNIMPLEMENTED."""


def _file() -> descriptor_pb2.FileDescriptorProto:
    file = descriptor_pb2.FileDescriptorProto(name="dyn/kserve_grpc_service.proto", package=PACKAGE, syntax="proto3")
    types: dict[str, descriptor_pb2.DescriptorProto] = {}
    for name in MESSAGES:  # parents before the types nested in them (the table's order)
        parent, _, leaf = name.rpartition(".")
        types[name] = (types[parent].nested_type if parent else file.message_type).add(name=leaf)
    for name, fields in MESSAGES.items():
        message = types[name]
        for field_name, number, kind in fields:
            _add_field(message, name, field_name, number, kind)
    service = file.service.add(name=SERVICE.rpartition(".")[2])
    for rpc, (request, response, streaming) in RPCS.items():
        service.method.add(
            name=rpc,
            input_type=f".{PACKAGE}.{request}",
            output_type=f".{PACKAGE}.{response}",
            client_streaming=streaming,
            server_streaming=streaming,
        )
    return file


def _add_field(message: descriptor_pb2.DescriptorProto, owner: str, name: str, number: int, kind: str) -> None:
    f = descriptor_pb2.FieldDescriptorProto
    field = message.field.add(name=name, number=number, label=f.LABEL_OPTIONAL)
    if kind == "map":  # map<string, InferParameter>: a repeated entry message of its own
        entry = message.nested_type.add(name="ParametersEntry")
        entry.options.map_entry = True
        entry.field.add(name="key", number=1, label=f.LABEL_OPTIONAL, type=f.TYPE_STRING)
        entry.field.add(
            name="value", number=2, label=f.LABEL_OPTIONAL, type=f.TYPE_MESSAGE, type_name=f".{PACKAGE}.InferParameter"
        )
        kind = f"*{owner}.ParametersEntry"
    if kind.startswith("|"):
        if not message.oneof_decl:
            message.oneof_decl.add(name="parameter_choice")
        field.oneof_index, kind = 0, kind[1:]
    if kind.startswith("*"):
        field.label, kind = f.LABEL_REPEATED, kind[1:]
    if kind in _SCALARS:
        field.type = _SCALARS[kind]
    else:
        field.type, field.type_name = f.TYPE_MESSAGE, f".{PACKAGE}.{kind}"


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file())


def message(name: str) -> Any:
    """The class of message `name` (`ModelInferRequest`, `ModelInferRequest.InferInputTensor`, ...)."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


def descriptor(name: str) -> Any:
    """The descriptor of message `name` (the tests compare it with the client's)."""
    return _POOL.FindMessageTypeByName(f"{PACKAGE}.{name}")


InferRequest = message("ModelInferRequest")
InferResponse = message("ModelInferResponse")
OutputTensor = message("ModelInferResponse.InferOutputTensor")
StreamResponse = message("ModelStreamInferResponse")
MetadataResponse = message("ModelMetadataResponse")
