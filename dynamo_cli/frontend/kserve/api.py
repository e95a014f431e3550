"""ModelInfer and ModelStreamInfer as `Api`s of the edge's one lifecycle (frontend/lifecycle.py): a completion
underneath, so a gRPC request is checked, tokenized, routed, queued, migrated, counted and limited by its tenant
exactly as the same request on /v1/completions. Replies are protocol buffers written through the lifecycle's
`send` (server.py turns them, and the HTTP errors, back into gRPC)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.types import Receive, Send

from dynamo_cli.errors import DynError, RequestError
from dynamo_cli.frontend.kserve import proto
from dynamo_cli.frontend.kserve.tensors import InferCall, infer_response, read_request
from dynamo_cli.frontend.openai import CompletionRequest, parse_completion
from dynamo_cli.frontend.pipeline import Generation
from dynamo_cli.frontend.replies import Write, reply_json, stream_sse, watching


@dataclass(frozen=True, slots=True)
class KServeRequest:
    call: InferCall
    completion: CompletionRequest

    @property
    def stream(self) -> bool:
        return self.completion.stream


@dataclass(frozen=True, slots=True)
class KServeApi:
    """One of the two inference RPCs (`on_stream`: ModelStreamInfer, whose every reply is a
    ModelStreamInferResponse)."""

    name: str
    on_stream: bool
    id_prefix: str = "cmpl-"

    def parse(self, body: bytes) -> KServeRequest:
        call = read_request(body)
        if call.completion.get("stream") and not self.on_stream:
            raise RequestError("streaming needs ModelStreamInfer; ModelInfer answers once", param="streaming")
        return KServeRequest(call, parse_completion(msgspec.json.encode(call.completion)))

    def to_generate(self, request: KServeRequest) -> CompletionRequest:
        return request.completion

    async def reply(self, request: KServeRequest, generations: list[Generation], send: Send, receive: Receive) -> str:
        gen, call = generations[0], request.call
        d = gen.dispatch
        if not request.stream:

            async def body() -> bytes:
                text = "".join([piece async for piece in gen.text()])
                return self._bytes(infer_response(call, text, gen.finish_reason or "length"))

            async with watching(receive, d.abort):
                status = await reply_json(send, body, list, d.plan.request_id)
            return "cancelled" if d.is_aborted else status
        final = False if call.empty_final else None

        async def produce(write: Write) -> bytes:
            async for piece in gen.text():
                if piece:
                    await write(self._bytes(infer_response(call, piece, None, final=final)))
            last = infer_response(call, "", gen.finish_reason or "length", final=final)
            if not call.empty_final:
                return self._bytes(last)
            await write(self._bytes(last))
            return self._bytes(infer_response(call, None, None, final=True))

        def error_event(exc: DynError) -> bytes:
            return bytes(proto.StreamResponse(error_message=str(exc)).SerializeToString())

        return await stream_sse(send, receive, [], produce, d.abort, error_event, d.plan.request_id, done=b"")

    def _bytes(self, response: Any) -> bytes:
        message = proto.StreamResponse(infer_response=response) if self.on_stream else response
        return bytes(message.SerializeToString())


INFER = KServeApi("kserve_infer", on_stream=False)
STREAM_INFER = KServeApi("kserve_stream_infer", on_stream=True)
