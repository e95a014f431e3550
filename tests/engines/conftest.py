"""Fixtures of the engine tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.engines.kv_publisher import Publisher, serving


@pytest.fixture
async def publisher() -> AsyncIterator[Publisher]:
    """An engine's KV event publisher on loopback (kv_publisher.py)."""
    async for p in serving():
        yield p
