"""A ModelInferRequest read as the completion it asks, every tensor and parameter checked first (pure: no I/O).

An LLM is served as Dynamo and Triton's LLM backends name its tensors: `text_input` (BYTES, one element) in,
`text_output` (BYTES) and `finish_reason` (BYTES) out, `streaming` (BOOL, or `stream` as Triton's vLLM backend
names it) asking for tokens as they come. The sampling parameters come as request parameters or as one-element
input tensors of the same names (`max_tokens` INT32, `temperature` FP32, ...); their ranges are the completion
API's, checked by its parser, so an error names the same field on either protocol.

Everything here is a stranger's bytes: a shape is never used to size anything, a raw buffer must hold exactly what
its shape and type say, and each bad tensor is a RequestError naming it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from dynamo_cli.errors import RequestError
from dynamo_cli.frontend.kserve import proto

TEXT_INPUT, TEXT_OUTPUT, FINISH_REASON = "text_input", "text_output", "finish_reason"
STREAMING = ("streaming", "stream")
OUTPUTS = (TEXT_OUTPUT, FINISH_REASON)
EMPTY_FINAL = "triton_enable_empty_final_response"
"""Triton's request parameter: end a stream with an empty response marked `triton_final_response`."""
MAX_INPUTS = 16
MAX_PARAMETERS = 32

SAMPLING: dict[str, type] = {
    "max_tokens": int,
    "min_tokens": int,
    "top_k": int,
    "seed": int,
    "temperature": float,
    "top_p": float,
    "min_p": float,
    "frequency_penalty": float,
    "presence_penalty": float,
    "repetition_penalty": float,
    "ignore_eos": bool,
    "stop": str,
}
"""The completion's fields a request may set, as a parameter or a one-element tensor, and their kind."""

_FIXED = {  # datatype -> struct format of one element (little-endian)
    "BOOL": "?",
    "INT8": "b",
    "INT16": "h",
    "INT32": "i",
    "INT64": "q",
    "UINT8": "B",
    "UINT16": "H",
    "UINT32": "I",
    "UINT64": "Q",
    "FP32": "f",
    "FP64": "d",
}
_CONTENTS = {  # datatype -> the InferTensorContents field holding it
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
_KINDS = {  # what each kind of field accepts
    bool: ("BOOL",),
    int: ("INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"),
    float: ("FP32", "FP64"),
    str: ("BYTES",),
}


_NOUNS = {bool: "a bool_param", int: "an int64_param", float: "a double_param", str: "a string_param"}


@dataclass(frozen=True, slots=True)
class InferCall:
    """One ModelInferRequest, read and checked."""

    model: str
    id: str
    """The client's request id, echoed on each response (tritonclient matches a stream's responses by it)."""
    completion: dict[str, Any]
    """The /v1/completions body it asks (model, prompt, stream and the sampling fields given)."""
    outputs: tuple[str, ...]
    """The output tensors to send (all of OUTPUTS unless the request names some)."""
    empty_final: bool


def read_request(body: bytes) -> InferCall:
    """A ModelInferRequest's bytes -> the call (RequestError naming the bad tensor, parameter or field)."""
    try:
        request = proto.InferRequest.FromString(body)
    except DecodeError:
        raise RequestError("the message is not a ModelInferRequest", param="request") from None
    if request.model_version not in ("", "1"):
        version = request.model_version[:32]
        raise RequestError(f"model_version '{version}' is unknown; versions: 1", param="model_version")
    completion: dict[str, Any] = {"model": request.model_name}
    empty_final = _read_parameters(request.parameters, completion)
    _read_inputs(request, completion)
    if "prompt" not in completion:
        raise RequestError(f"input tensor '{TEXT_INPUT}' (BYTES, one element: the prompt) is missing", param=TEXT_INPUT)
    outputs = tuple(o.name for o in request.outputs) or OUTPUTS
    for name in outputs:
        if name not in OUTPUTS:
            raise RequestError(f"output tensor '{name}' is unknown; outputs: {', '.join(OUTPUTS)}", param=name)
    return InferCall(request.model_name, request.id[:256], completion, outputs, empty_final)


def _read_parameters(parameters: Any, completion: dict[str, Any]) -> bool:
    if len(parameters) > MAX_PARAMETERS:
        raise RequestError(f"{len(parameters)} parameters; at most {MAX_PARAMETERS}", param="parameters")
    empty_final = False
    for name, value in parameters.items():
        choice = value.WhichOneof("parameter_choice")
        given = getattr(value, choice) if choice is not None else None
        if name == EMPTY_FINAL:
            empty_final = _of_kind(given, bool, name)
        elif name in SAMPLING:
            completion[name] = _of_kind(given, SAMPLING[name], name)
        else:
            raise RequestError(f"parameter '{name}' is unknown; parameters: {', '.join(SAMPLING)}", param=name)
    return empty_final


def _of_kind(value: Any, kind: type, name: str) -> Any:
    if kind is float and type(value) is int:
        return float(value)
    if type(value) is not kind:
        raise RequestError(f"parameter '{name}' must be {_NOUNS[kind]}", param=name)
    return value


def _read_inputs(request: Any, completion: dict[str, Any]) -> None:
    inputs, raw = request.inputs, request.raw_input_contents
    if len(inputs) > MAX_INPUTS:
        raise RequestError(f"{len(inputs)} input tensors; at most {MAX_INPUTS}", param="inputs")
    if raw and len(raw) != len(inputs):
        raise RequestError(
            f"{len(raw)} raw_input_contents for {len(inputs)} inputs: give every input raw, or none", param="inputs"
        )
    seen: set[str] = set()
    for index, tensor in enumerate(inputs):
        name = tensor.name
        if name in seen:
            raise RequestError(f"input tensor '{name}' is given twice", param=name)
        seen.add(name)
        kind: type
        if name == TEXT_INPUT:
            kind, field = str, "prompt"
        elif name in STREAMING:
            kind, field = bool, "stream"
        elif name in SAMPLING:
            kind, field = SAMPLING[name], name
        else:
            known = ", ".join((TEXT_INPUT, *STREAMING, *SAMPLING))
            raise RequestError(f"input tensor '{name}' is unknown; inputs: {known}", param=name)
        completion[field] = _scalar(tensor, raw[index] if raw else None, kind)


def _scalar(tensor: Any, raw: bytes | None, kind: type) -> Any:
    """The one element of `tensor` (its raw bytes, else its contents), as `kind`."""
    name, datatype = tensor.name, tensor.datatype
    if datatype not in _KINDS[kind]:
        allowed = " or ".join(_KINDS[kind])
        raise RequestError(f"input tensor '{name}' must be {allowed}, got '{datatype[:32]}'", param=name)
    if any(d != 1 for d in tensor.shape):
        shape = list(tensor.shape)[:8]
        raise RequestError(f"input tensor '{name}' must hold one element (shape [1]), got shape {shape}", param=name)
    if raw is not None:
        values = _from_raw(raw, datatype, name)
    else:
        values = list(getattr(tensor.contents, _CONTENTS[datatype]))
    if len(values) != 1:
        raise RequestError(f"input tensor '{name}' holds {len(values)} elements; it must hold one", param=name)
    value = values[0]
    if kind is str:
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise RequestError(f"input tensor '{name}' is not UTF-8 text", param=name) from None
    return float(value) if kind is float else kind(value)


def _from_raw(raw: bytes, datatype: str, name: str) -> list[Any]:
    if datatype == "BYTES":  # each element: its length (4 bytes, little-endian), then its bytes
        if len(raw) < 4:
            raise RequestError(f"input tensor '{name}': raw BYTES shorter than its 4-byte length", param=name)
        (size,) = struct.unpack_from("<I", raw)
        if size != len(raw) - 4:
            raise RequestError(
                f"input tensor '{name}': raw BYTES of {len(raw) - 4} bytes after a length of {size}", param=name
            )
        return [raw[4:]]
    fmt = "<" + _FIXED[datatype]
    if len(raw) != struct.calcsize(fmt):
        raise RequestError(
            f"input tensor '{name}': {len(raw)} raw bytes for one {datatype} ({struct.calcsize(fmt)})", param=name
        )
    return list(struct.unpack(fmt, raw))


def infer_response(call: InferCall, text: str | None, finish_reason: str | None, *, final: bool | None = None) -> Any:
    """The ModelInferResponse carrying `text` and the finish reason, each where there is one (neither: the empty
    response that ends a stream); `final`: Triton's `triton_final_response` parameter, for a client that asked for
    an empty final response."""
    response = proto.InferResponse(model_name=call.model, model_version="1", id=call.id)
    for name in call.outputs:
        value = text if name == TEXT_OUTPUT else finish_reason
        if value is None:
            continue
        response.outputs.add(name=name, datatype="BYTES", shape=[1])
        data = value.encode()
        response.raw_output_contents.append(struct.pack("<I", len(data)) + data)
    if final is not None:
        response.parameters["triton_final_response"].bool_param = final
    return response
