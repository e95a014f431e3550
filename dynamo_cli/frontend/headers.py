"""The frontend's own HTTP headers: what it reads from a request (ids, pins, priorities) and writes back
(which request, worker and router served it, and the route's explanation)."""

from __future__ import annotations

from typing import Any

import msgspec

from dynamo_cli.errors import RequestError
from dynamo_cli.frontend.pipeline import Generation

MAX_REQUEST_ID = 128
"""Longest x-request-id taken from a client."""


def client_request_id(header: bytes | None) -> str | None:
    """The caller's x-request-id, when it is printable ASCII of at most MAX_REQUEST_ID bytes."""
    if not header:
        return None
    if len(header) > MAX_REQUEST_ID or not all(0x20 < byte < 0x7F for byte in header):
        raise RequestError(
            f"header x-request-id must be 1-{MAX_REQUEST_ID} printable ASCII characters", param="x-request-id"
        )
    return header.decode("ascii")


def int_header(header: bytes | None, name: str, low: int, high: int) -> int | None:
    """An integer header within [low, high], or None when absent; else a 400 naming the header."""
    if not header:
        return None
    try:
        value = int(header)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise RequestError(f"header {name} must be an integer in {low}..{high}", param=name)
    return value


def pinned_header(header: bytes | None) -> int | None:
    if not header:
        return None
    try:
        return int(header, 16)
    except ValueError:
        raise RequestError(
            f"x-worker-instance-id '{header.decode(errors='replace')}' is not a hex instance id"
        ) from None


def id_headers(gen: Generation) -> list[tuple[bytes, bytes]]:
    """x-request-id, the backend that serves and, behind `dyn router`s, the router that routed."""
    d = gen.dispatch
    headers = [
        (b"x-request-id", (d.plan.client_request_id or d.plan.request_id).encode()),
        (b"x-worker-instance-id", f"{d.served_by or 0:x}".encode()),
    ]
    if d.served_rank is not None:
        headers.append((b"x-dyn-dp-rank", str(d.served_rank).encode()))
    if d.router_id is not None:
        headers.append((b"x-dyn-router-instance-id", f"{d.router_id:x}".encode()))
    if d.plan.is_explained and d.decision is not None:
        explanation = d.decision.explanation
        if d.lora_loaded is not None:  # a LoRA request: was its adapter loaded where it went, or loaded there first
            explanation = {**explanation, "lora": {"name": d.plan.request.lora, "was_loaded": d.lora_loaded}}
        headers.append((b"x-dyn-route", msgspec.json.encode(_hexid_headers(explanation))))
    prefill = d.prefill.explanation
    if d.plan.is_explained and prefill is not None:
        headers.append((b"x-dyn-prefill-route", msgspec.json.encode(_hexid_headers(prefill))))
    if prefill is not None and "prefill_worker_id" in prefill:
        headers.append((b"x-dyn-prefill-instance-id", f"{prefill['prefill_worker_id']:x}".encode()))
    return headers


def _hexid_headers(explanation: dict[str, Any]) -> dict[str, Any]:
    """Worker ids as the hex strings every other place shows."""

    def fix(value: Any, key: str = "") -> Any:
        if isinstance(value, dict):
            return {k: fix(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [fix(v, key) for v in value]
        return f"{value:x}" if key.endswith("worker_id") and isinstance(value, int) else value

    return fix(explanation)  # type: ignore[no-any-return]


def too_large(size: int, limit: int) -> RequestError:
    error = RequestError(f"request body of {size} bytes exceeds the {limit}-byte limit", code="payload_too_large")
    error.status = 413
    return error
