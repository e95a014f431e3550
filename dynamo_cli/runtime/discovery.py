"""Discovery (the control plane): a key-value store with one lease per process and prefix watches.

Keys written under a process's lease vanish when the lease expires (the process died) or is
revoked (it exited cleanly); watchers of a prefix see that as a delete. Two backends implement the
same Protocol: `embedded` (files on one host, no server) and `etcd` (multi-node).
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import msgspec

DEFAULT_TTL_S = 10.0
"""Lease time-to-live, as Dynamo's etcd lease (seconds)."""


class WatchKind(enum.Enum):
    """What happened to a key."""

    PUT = "put"  # created or updated
    DELETE = "delete"  # removed, or its lease expired


class WatchEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One change under a watched prefix."""

    kind: WatchKind
    key: str
    value: bytes = b""


class Discovery(Protocol):
    """Leased key-value store with prefix watches. One lease per process."""

    @property
    def lease_id(self) -> int:
        """This process's lease id; also its instance id on every plane."""
        ...

    async def start(self) -> None:
        """Connect and grant the process lease; raise PlaneUnavailable if the store is unreachable."""
        ...

    async def put(self, key: str, value: bytes, *, leased: bool = True) -> None:
        """Write `key`; leased keys vanish with the process's lease."""
        ...

    async def delete(self, key: str) -> None:
        """Remove `key` (no error when absent)."""
        ...

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        """Every live key under `prefix` with its value."""
        ...

    def watch(self, prefix: str) -> AsyncIterator[WatchEvent]:
        """Yield a PUT for every existing key under `prefix`, then every change, until closed."""
        ...

    async def close(self) -> None:
        """Revoke the lease (its keys vanish at once) and disconnect. Idempotent."""
        ...


@runtime_checkable
class HostLocal(Protocol):
    """A discovery store kept in a directory of this host (the embedded one): other processes share
    it by that directory."""

    @property
    def root(self) -> Path:
        """The store's directory."""
        ...
