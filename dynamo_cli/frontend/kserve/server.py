"""The KServe v2 gRPC server (`--kserve-grpc-port`): grpc.aio, beside the HTTP server of the same frontend.

Each RPC takes its request as bytes and parses it itself, so a bad message is an INVALID_ARGUMENT naming what is
wrong, never the library's INTERNAL. ModelInfer and ModelStreamInfer go through the frontend's gate and its one
request lifecycle (kserve/api.py); the reply's HTTP status becomes the gRPC status (or, on a stream, a response
carrying `error_message`, as Triton sends). The metadata RPCs pass the API-key gate too; ServerLive and ServerReady
are probes, open as /live and /health are. With TLS the same certificate, key and client CA as HTTPS.

A stream's requests run at once, each its own task owned by the RPC (at most MAX_STREAM_INFLIGHT: then the stream
is not read until one ends). The client leaving cancels the RPC: each of its requests then sees its client gone,
as an HTTP request does, and aborts its work (counted as cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import msgspec
from google.protobuf.message import DecodeError
from starlette.types import Message

from dynamo_cli.config import FrontendConfig
from dynamo_cli.errors import ConfigError, DynError, ModelNotFound
from dynamo_cli.frontend.app import Frontend
from dynamo_cli.frontend.kserve import proto
from dynamo_cli.frontend.kserve.api import INFER, STREAM_INFER, KServeApi
from dynamo_cli.frontend.kserve.tensors import OUTPUTS, STREAMING, TEXT_INPUT
from dynamo_cli.frontend.openapi import package_version
from dynamo_cli.frontend.replies import error_reply, internal
from dynamo_cli.runtime.supervisor import cancel_and_wait

logger = logging.getLogger(__name__)

MAX_STREAM_INFLIGHT = 256
"""Requests of one ModelStreamInfer stream generating at once."""

GONE_S = 5.0
"""How long a request whose client left may take to close its work before it is cancelled."""

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def grpc_code(status: int) -> grpc.StatusCode:
    """The gRPC status of an HTTP one (500 and the unmapped: INTERNAL)."""
    return _CODES.get(status, grpc.StatusCode.INTERNAL)


class _Exchange:
    """One request's ASGI side, as the lifecycle sees it: its body once, then a wait for the client to leave; what
    the lifecycle sends, kept (`write` None) or passed on message by message."""

    def __init__(self, body: bytes, write: Callable[[bytes], Awaitable[None]] | None = None) -> None:
        self._body: bytes | None = body
        self._write = write
        self.gone = asyncio.Event()
        """Set when the client left (the RPC was cancelled)."""
        self.status = 0
        self.body = b""

    async def receive(self) -> Message:
        body, self._body = self._body, None
        if body is not None:
            return {"type": "http.request", "body": body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            body = message.get("body", b"")
            if self.status == 200 and self._write is not None:
                if body and not self.gone.is_set():
                    await self._write_or_gone(body)
            else:
                self.body += body

    async def _write_or_gone(self, body: bytes) -> None:
        """Write to the stream; where it takes no more (the client left and its cancellation has not reached this
        request yet, grpc's ExecuteBatchError), the client is gone: the lifecycle aborts the work and counts it
        cancelled, and the rest is dropped."""
        assert self._write is not None
        try:
            await self._write(body)
        except Exception as exc:
            logger.debug("a KServe stream took no more responses: %r", exc)
            self.gone.set()

    def error_message(self) -> str:
        """The message of the OpenAI-shaped error the lifecycle sent."""
        try:
            return str(msgspec.json.decode(self.body)["error"]["message"])
        except (msgspec.DecodeError, KeyError, TypeError):
            return f"HTTP {self.status}"


def _headers(context: grpc.aio.ServicerContext) -> list[tuple[bytes, bytes]]:
    """The call's metadata as HTTP headers (where the API key and the x-dyn-* headers come)."""
    return [
        (key.lower().encode(), value.encode() if isinstance(value, str) else bytes(value))
        for key, value in (context.invocation_metadata() or ())
    ]


def _scope(headers: list[tuple[bytes, bytes]], rpc: str) -> dict[str, Any]:
    """One request's ASGI scope (its own: the lifecycle writes into it)."""
    path = f"/{proto.SERVICE}/{rpc}"
    return {"type": "http", "method": "POST", "path": path, "headers": headers, "scheme": "grpc", "http_version": "2"}


class KServeServer:
    """The gRPC server of one frontend."""

    def __init__(self, config: FrontendConfig, app: Frontend) -> None:
        self.config = config
        self.app = app
        self.port = 0
        """The port it listens on, once `start` returned."""
        self._server: grpc.aio.Server | None = None

    async def start(self) -> int:
        """Bind and serve; the port (`--kserve-grpc-port 0`: a free one)."""
        limit = self.config.max_body_bytes
        options = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            ("grpc.so_reuseport", 0),  # a port another process holds is an error, not shared
        ]
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(proto.SERVICE, self._handlers()),))
        host, port = self.config.host, self.config.kserve_grpc_port or 0
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            tls = self._credentials()
            bound = server.add_secure_port(address, tls) if tls is not None else server.add_insecure_port(address)
        except RuntimeError:
            bound = 0
        if not bound:
            raise ConfigError(f"cannot listen on {address} for KServe gRPC; pick another --kserve-grpc-port")
        await server.start()
        self._server, self.port = server, int(bound)
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=min(5.0, self.config.graceful_shutdown_s))

    def _credentials(self) -> grpc.ServerCredentials | None:
        tls = self.config.tls
        if tls.cert_file is None or tls.key_file is None:
            return None
        pair = (Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())
        ca = Path(tls.ca_file).read_bytes() if tls.ca_file is not None else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def _handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        def unary(rpc: Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(_guarded(rpc))  # raw bytes: each RPC parses its message

        return {
            "ServerLive": unary(self._live),
            "ServerReady": unary(self._ready),
            "ModelReady": unary(self._model_ready),
            "ServerMetadata": unary(self._server_metadata),
            "ModelMetadata": unary(self._model_metadata),
            "ModelInfer": unary(self._infer),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(_guarded(self._stream_infer)),
        }

    ##### Probes and metadata #####

    async def _live(self, body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await _parse(context, "ServerLiveRequest", body)
        return _encode("ServerLiveResponse", live=True)

    async def _ready(self, body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await _parse(context, "ServerReadyRequest", body)
        return _encode("ServerReadyResponse", ready=bool(self.app.registry.servable()))

    async def _model_ready(self, body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await _parse(context, "ModelReadyRequest", body)
        async with self._admitted(context):
            ready = request.version in ("", "1") and self._serves(request.name)
        return _encode("ModelReadyResponse", ready=ready)

    async def _server_metadata(self, body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await _parse(context, "ServerMetadataRequest", body)
        async with self._admitted(context):
            return _encode("ServerMetadataResponse", name="dyn", version=package_version(), extensions=[])

    async def _model_metadata(self, body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await _parse(context, "ModelMetadataRequest", body)
        async with self._admitted(context):
            if not self._serves(request.name):
                await context.abort(grpc.StatusCode.NOT_FOUND, f"model '{request.name[:256]}' is not served here")
        response = proto.MetadataResponse(name=request.name, versions=["1"], platform="dyn")
        response.inputs.add(name=TEXT_INPUT, datatype="BYTES", shape=[1])
        response.inputs.add(name=STREAMING[0], datatype="BOOL", shape=[1])
        for name in OUTPUTS:
            response.outputs.add(name=name, datatype="BYTES", shape=[-1])
        return bytes(response.SerializeToString())

    def _serves(self, name: str) -> bool:
        try:
            self.app.registry.resolve(name)
        except ModelNotFound:
            return False
        return True

    @contextlib.asynccontextmanager
    async def _admitted(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Past the API-key gate (when keys are configured), as every HTTP path but the probes."""
        gate = self.app.gate
        if gate is None:
            yield
            return
        try:
            admission = gate.admit(_headers(context), time.monotonic())
        except DynError as exc:
            status, _, _ = error_reply(exc)
            await context.abort(grpc_code(status), str(exc))
        try:
            yield
        finally:
            admission.release()

    ##### Inference #####

    async def _serve(self, api: KServeApi, scope: dict[str, Any], exchange: _Exchange) -> None:
        """The request through the frontend's lifecycle, in a task of its own: the RPC cancelled (the client left),
        the lifecycle sees the client gone, aborts the work and counts it cancelled, as for an HTTP client."""
        task = asyncio.create_task(self.app.serve_api(api, scope, exchange.receive, exchange.send))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            exchange.gone.set()
            done, _ = await asyncio.wait({task}, timeout=GONE_S)
            if not done:
                await cancel_and_wait(task)
            raise

    async def _infer(self, body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        exchange = _Exchange(body)
        await self._serve(INFER, _scope(_headers(context), "ModelInfer"), exchange)
        if exchange.status != 200:
            await context.abort(grpc_code(exchange.status), exchange.error_message())
        return exchange.body

    async def _stream_infer(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        lock, slots = asyncio.Lock(), asyncio.Semaphore(MAX_STREAM_INFLIGHT)
        headers = _headers(context)  # the stream's, read once for all its requests

        async def write(data: bytes) -> None:
            async with lock:  # one message at a time on the stream
                await context.write(data)

        async with asyncio.TaskGroup() as group:  # the RPC's cancellation cancels every request of it
            async for body in requests:
                await slots.acquire()
                group.create_task(self._one_of_stream(body, headers, write, slots))

    async def _one_of_stream(
        self,
        body: bytes,
        headers: list[tuple[bytes, bytes]],
        write: Callable[[bytes], Awaitable[None]],
        slots: asyncio.Semaphore,
    ) -> None:
        try:
            exchange = _Exchange(body, write)
            await self._serve(STREAM_INFER, _scope(headers, "ModelStreamInfer"), exchange)
            if exchange.status not in (0, 200):  # refused before its reply: the stream goes on, as Triton's does
                await write(_encode("ModelStreamInferResponse", error_message=exchange.error_message()))
        finally:
            slots.release()


def _guarded(rpc: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]) -> Any:
    """`rpc`, a bug in it an INTERNAL status with an error id the log has (grpc would send the exception's text)."""

    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await rpc(request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(internal(exc, "serving a KServe gRPC call")))

    return guarded


async def _parse(context: grpc.aio.ServicerContext, name: str, body: bytes) -> Any:
    try:
        return proto.message(name).FromString(body)
    except DecodeError:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the message is not a {name}")


def _encode(message: str, /, **fields: Any) -> bytes:
    return bytes(proto.message(message)(**fields).SerializeToString())
