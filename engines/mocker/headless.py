"""The mocker's multi-node mode: a follower node of a simulated engine that spans several nodes.

The leader's mocker simulates the whole engine (its timing, its KV cache, its events); a follower holds no part of
the simulation. What is real is the group around them (dynamo_cli/node_group.py): the leader serves only once
every follower joined, a follower's death takes the leader out of routing at once and the leader's ends the
followers, and `dyn serve --nodes-per-worker N` restarts the group as a unit, as for vLLM's headless nodes.
"""

from __future__ import annotations

import asyncio

from dynamo_cli.engine import EngineArgs
from dynamo_cli.errors import ConfigError


async def run_headless(args: EngineArgs) -> None:
    """A follower's part (`dyn worker --engine mocker --nnodes N --node-rank R`, R > 0): nothing to compute, so it
    waits until the group ends it (cancelled)."""
    if args.group.nnodes < 2 or args.group.node_rank < 1:
        raise ConfigError(
            f"the mocker's headless part is a follower's: got node {args.group.node_rank} of {args.group.nnodes}"
        )
    await asyncio.Event().wait()
