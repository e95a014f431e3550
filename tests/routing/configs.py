"""Selection configs for the cost tests: a `KvRouterConfig`'s knobs at `block_size`, as the router builds them."""

from __future__ import annotations

from typing import Any

from dynamo_cli.config import KvRouterConfig
from dynamo_cli.routing.cost import CostConfig
from dynamo_cli.routing.tier_costs import AS_DEVICE, TierCosts


def cost_config(block_size: int, *, tiers: TierCosts = AS_DEVICE, **knobs: Any) -> CostConfig:
    """A CostConfig of KvRouterConfig(block_size=block_size, **knobs) with `tiers`' hit costs."""
    return CostConfig(block_size, KvRouterConfig(block_size=block_size, **knobs), tiers)
