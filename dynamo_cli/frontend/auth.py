"""Who may use the frontend: API keys checked in constant time, and per-key rate and concurrency limits.

Pure and synchronous (the clock is passed in), so it is tested without sockets. The frontend calls
`Gate.admit` before it reads a request's body and `Admission.release` when the response is done.

NOTE: keys are compared as SHA-256 digests with `hmac.compare_digest` against every configured key,
with no early exit, so neither the time taken nor its dependence on a key's length tells a caller
how close a guess was or which key it matched.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dynamo_cli.config import AuthConfig
from dynamo_cli.errors import RateLimited, RequestError

OPEN_PATHS = frozenset({"/health", "/live"})
"""Paths served without a key (probes); `/metrics` joins them unless `--metrics-require-key`."""


class Unauthorized(RequestError):
    """401: no API key, or one that is not configured here."""

    status = 401

    def __init__(self, reason: str) -> None:
        super().__init__(
            f"{reason}; send `Authorization: Bearer <key>` (or `x-api-key: <key>`) with a key this server accepts",
            code="invalid_api_key",
        )


def presented_key(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The key a request carries: `Authorization: Bearer KEY`, else `x-api-key: KEY`."""
    fallback = None
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value.strip():
            fallback = value.strip()
    return fallback


@dataclass(slots=True)
class TokenBucket:
    """`rate` tokens a second up to `burst`; each request takes one."""

    rate: float
    burst: float
    tokens: float
    updated_at: float

    def take(self, now: float) -> float:
        """Take a token: 0.0 when granted, else the seconds until one is available."""
        self.tokens = min(self.burst, self.tokens + (now - self.updated_at) * self.rate)
        self.updated_at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class KeyTable:
    """The configured keys, held as digests; `match` finds a presented one in constant time."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def match(self, presented: bytes | None) -> int | None:
        """Index of the key `presented` equals, or None. Compares against every key, always."""
        digest = hashlib.sha256(presented or b"").digest()
        found = None
        for index, key in enumerate(self._digests):
            if hmac.compare_digest(digest, key):
                found = index
        return found


@dataclass(slots=True)
class Admission:
    """One admitted request; `release` once its response is over (idempotent)."""

    gate: Gate | None
    key_index: int

    def release(self) -> None:
        if self.gate is not None:
            self.gate.inflight[self.key_index] -= 1
            self.gate = None


class Gate:
    """Authentication plus per-key limits for the frontend's routes."""

    def __init__(self, config: AuthConfig) -> None:
        self.config = config
        self._table = KeyTable(config.api_keys)
        self._open = OPEN_PATHS if config.metrics_require_key else OPEN_PATHS | {"/metrics"}
        burst = max(1.0, config.rps)
        self._buckets = [TokenBucket(config.rps, burst, burst, 0.0) for _ in config.api_keys]
        self.inflight = [0] * len(config.api_keys)
        """Requests open per key index."""

    def is_open(self, path: str) -> bool:
        """True when `path` is served without a key."""
        return path in self._open

    def admit(self, headers: Iterable[tuple[bytes, bytes]], now: float) -> Admission:
        """Admit a request or raise Unauthorized / RateLimited. `now` is a monotonic clock in seconds."""
        presented = presented_key(headers)
        index = self._table.match(presented)
        if index is None:
            raise Unauthorized("missing API key" if presented is None else "invalid API key")
        limit = self.config.max_inflight
        if limit and self.inflight[index] >= limit:
            raise RateLimited(f"this API key already has {limit} requests in flight (--api-key-max-inflight)", 1.0)
        if self.config.rps:
            wait = self._buckets[index].take(now)
            if wait:
                raise RateLimited(f"this API key is over {self.config.rps:g} requests/s (--api-key-rps)", wait)
        self.inflight[index] += 1
        return Admission(self, index)
