"""`/v1/files` and `/v1/batches`, as OpenAI's API defines them, over a `BatchStore` and a `BatchRunner`.

The official client's `files.create(purpose="batch")`, `files.content`, `batches.create/retrieve/list/cancel`
work unchanged. An upload is streamed to disk, counted as it comes: over `max_file_bytes` is a 413, over
`max_lines` a 400, each naming the limit. The lines themselves are checked when the batch starts
(batch/lines.py), so one bad line never refuses a file.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive

from dynamo_cli.batch.lines import ENDPOINTS
from dynamo_cli.batch.runner import BatchRunner
from dynamo_cli.batch.store import TERMINAL, BatchStore, Status, new_id
from dynamo_cli.errors import Overloaded, RequestError
from dynamo_cli.frontend.openai import check_depth
from dynamo_cli.frontend.replies import error_response

logger = logging.getLogger(__name__)

WINDOWS = {"24h": 24 * 3600}
"""`completion_window` values and their seconds (OpenAI offers 24h only)."""
MAX_METADATA = 16
"""Key/value pairs in a batch's metadata (OpenAI's limits: 16 pairs, keys of 64 and values of 512 characters)."""
CHUNK = 1 << 20
FORM_OVERHEAD = 64 * 1024
"""Bytes of a multipart upload beyond its file's: boundaries, headers, the purpose field."""


class NotFound(RequestError):
    status = 404
    error_type = "not_found_error"


class TooLarge(RequestError):
    status = 413


class BatchApi:
    """The routes, mounted by the frontend under its API-key gate."""

    def __init__(self, store: BatchStore, runner: BatchRunner, max_file_bytes: int, max_lines: int) -> None:
        self.store = store
        self.runner = runner
        self.max_file_bytes = max_file_bytes
        self.max_lines = max_lines

    def routes(self) -> list[Route]:
        return [
            Route("/v1/files", self._replies(self.upload), methods=["POST"]),
            Route("/v1/files", self._replies(self.list_files), methods=["GET"]),
            Route("/v1/files/{file_id}", self._replies(self.get_file), methods=["GET"]),
            Route("/v1/files/{file_id}", self._replies(self.delete_file), methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", self._replies(self.content), methods=["GET"]),
            Route("/v1/batches", self._replies(self.create), methods=["POST"]),
            Route("/v1/batches", self._replies(self.list_batches), methods=["GET"]),
            Route("/v1/batches/{batch_id}", self._replies(self.retrieve), methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", self._replies(self.cancel), methods=["POST"]),
        ]

    def _replies(self, handler: Any) -> Any:
        """`handler` with its RequestErrors as OpenAI-shaped error replies, and its database out of reach (a
        PostgreSQL server down, a SQLite file locked past its timeout) as a 503."""
        unavailable = self.store.database.unavailable

        async def route(request: Request) -> Response:
            try:
                response: Response = await handler(request)
            except RequestError as exc:
                return error_response(exc)
            except unavailable as exc:
                logger.warning("batch database: %s", exc)
                return error_response(Overloaded(f"the batch database is out of reach ({type(exc).__name__})", 5.0))
            return response

        route.__name__ = handler.__name__
        return route

    # -- files -------------------------------------------------------------------------------------------

    async def upload(self, request: Request) -> Response:
        too_large = TooLarge(f"the file is over the limit of {self.max_file_bytes} bytes", param="file")
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > self.max_file_bytes + FORM_OVERHEAD:
            raise too_large
        # the body counted as it arrives too: a chunked upload names no length, and the form parser spools files
        request = Request(request.scope, _capped(request.receive, self.max_file_bytes + FORM_OVERHEAD, too_large))
        try:
            form = await request.form(max_files=1, max_fields=8)
        except (MultiPartException, HTTPException) as exc:
            raise RequestError(
                f"the upload is not a multipart form with purpose and file: {exc}", param="file"
            ) from None
        try:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise RequestError("purpose must be 'batch'", param="purpose")
            if not isinstance(upload, UploadFile):
                raise RequestError("file is missing", param="file")
            await self._check(upload)
            file_id = new_id("file-")
            filename = (upload.filename or "input.jsonl")[:255]
            await asyncio.to_thread(self.store.put_file, file_id, "batch", filename, upload.file)
        finally:
            await form.close()
        return JSONResponse(_file_object(await asyncio.to_thread(self.store.file, file_id)))

    async def _check(self, upload: UploadFile) -> None:
        """Refuse the upload past either limit (nothing kept then); else rewind it for the store to copy."""
        size = lines = 0
        while chunk := await upload.read(CHUNK):
            size, lines = size + len(chunk), lines + chunk.count(b"\n")
            if size > self.max_file_bytes:
                raise TooLarge(f"the file is over the limit of {self.max_file_bytes} bytes", param="file")
            if lines > self.max_lines:
                raise RequestError(f"the file has over the limit of {self.max_lines} lines", param="file")
        await upload.seek(0)

    async def list_files(self, request: Request) -> Response:
        limit = _limit(request, 10_000)
        rows = await asyncio.to_thread(
            self.store.files, request.query_params.get("purpose"), request.query_params.get("after"), limit + 1
        )
        return JSONResponse(_page([_file_object(row) for row in rows], limit))

    async def get_file(self, request: Request) -> Response:
        return JSONResponse(_file_object(await self._file(request)))

    async def delete_file(self, request: Request) -> Response:
        row = await self._file(request)
        await asyncio.to_thread(self.store.delete_file, row["id"])
        return JSONResponse({"id": row["id"], "object": "file", "deleted": True})

    async def content(self, request: Request) -> Response:
        row = await self._file(request)
        data = await asyncio.to_thread(self.store.file_bytes, row["id"])
        if data is None:
            raise NotFound(f"the file '{row['id']}' has no content any more", param="file_id")
        return Response(data, media_type="application/octet-stream")

    async def _file(self, request: Request) -> dict[str, Any]:
        file_id = request.path_params["file_id"]
        row = await asyncio.to_thread(self.store.file, file_id)
        if row is None:
            raise NotFound(f"no file {file_id!r}", param="file_id")
        return row

    # -- batches -----------------------------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        body = await _json(request)
        endpoint, window = body.get("endpoint"), body.get("completion_window")
        if endpoint not in ENDPOINTS:
            raise RequestError(f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
        if window not in WINDOWS:
            raise RequestError(f"completion_window must be one of {', '.join(WINDOWS)}", param="completion_window")
        metadata = _metadata(body.get("metadata"))
        file_id = body.get("input_file_id")
        row = await asyncio.to_thread(self.store.file, file_id) if isinstance(file_id, str) else None
        if row is None or row["purpose"] != "batch":
            raise RequestError(f"input_file_id {file_id!r} names no uploaded batch file", param="input_file_id")
        batch_id = new_id("batch_")
        await asyncio.to_thread(self.store.create_batch, batch_id, endpoint, str(file_id), WINDOWS[window], metadata)
        self.runner.wake()
        return JSONResponse(batch_object(await self._batch(batch_id)))

    async def retrieve(self, request: Request) -> Response:
        return JSONResponse(batch_object(await self._batch(request.path_params["batch_id"])))

    async def cancel(self, request: Request) -> Response:
        batch = await self._batch(request.path_params["batch_id"])
        if batch["status"] in TERMINAL:
            raise RequestError(f"batch {batch['id']} is {batch['status']}: it cannot be cancelled", param="batch_id")
        open_ = frozenset({Status.VALIDATING, Status.IN_PROGRESS, Status.FINALIZING})
        await asyncio.to_thread(self.store.set_status, batch["id"], Status.CANCELLING, only_from=open_)
        self.runner.wake()
        return JSONResponse(batch_object(await self._batch(batch["id"])))

    async def list_batches(self, request: Request) -> Response:
        limit = _limit(request, 100)
        rows = await asyncio.to_thread(self.store.batches, request.query_params.get("after"), limit + 1)
        return JSONResponse(_page([batch_object(row) for row in rows], limit))

    async def _batch(self, batch_id: str) -> dict[str, Any]:
        row = await asyncio.to_thread(self.store.batch, batch_id)
        if row is None:
            raise NotFound(f"no batch {batch_id!r}", param="batch_id")
        return row


def batch_object(row: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's Batch object from a store row."""
    stamps = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at")
    return {
        "id": row["id"],
        "object": "batch",
        "endpoint": row["endpoint"],
        "errors": json.loads(row["errors"]) if row["errors"] else None,
        "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"],
        "status": row["status"],
        "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"],
        "created_at": row["created_at"],
        "expires_at": row["expires_at"],
        **{stamp: row[stamp] for stamp in stamps},
        "cancelled_at": row["cancelled_at"],
        "request_counts": row["request_counts"],
        "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
    }


def _file_object(row: dict[str, Any] | None) -> dict[str, Any]:
    assert row is not None
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
    }


def _page(data: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    shown = data[:limit]
    return {
        "object": "list",
        "data": shown,
        "first_id": shown[0]["id"] if shown else None,
        "last_id": shown[-1]["id"] if shown else None,
        "has_more": len(data) > limit,
    }


def _limit(request: Request, most: int) -> int:
    raw = request.query_params.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise RequestError(f"limit must be an integer in 1..{most}", param="limit")
    return int(raw)


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    ok = isinstance(value, dict) and len(value) <= MAX_METADATA
    ok = ok and all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in value.items()
    )
    if not ok:
        raise RequestError(
            f"metadata must be an object of at most {MAX_METADATA} string pairs (keys of 64, values of 512 characters)",
            param="metadata",
        )
    return dict(value)


def _is_pair(key: Any, value: Any) -> bool:
    return isinstance(key, str) and isinstance(value, str) and len(key) <= 64 and len(value) <= 512


async def _json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > 64 * 1024:
        raise TooLarge("the body is over 64 KiB", param="body")
    check_depth(raw)  # before json.loads recurses into it
    try:
        body = json.loads(raw)
    except ValueError:
        raise RequestError("the body is not JSON", param="body") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object", param="body")
    return body


def _capped(receive: Receive, limit: int, error: RequestError) -> Receive:
    """`receive`, raising `error` once the request's body passes `limit` bytes."""
    seen = 0

    async def capped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise error
        return message

    return capped


__all__ = ["BatchApi", "batch_object"]
