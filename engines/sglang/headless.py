"""A follower node of a multi-node SGLang engine (`dyn worker --engine sglang --nnodes N --node-rank R`, R > 0).

The `dyn.headless` entry of the sglang engine, as Dynamo's SGLang worker runs a non-leader node: `sglang.Engine`
with the leader's server args (args.py) and `node_rank` R starts this node's scheduler processes, which join the
leader's at `dist_init_addr`; with `SGLANG_BLOCK_NONZERO_RANK_CHILDREN=0` the constructor returns instead of
joining them, and the follower holds the engine until the group ends it (cancelled), then shuts it down. NOTE: the
ranks of this node publish no KV events to dyn (their publisher would need the leader's relay address, chosen
when the leader starts); under attention DP across nodes only the leader node's ranks are indexed.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from dynamo_cli.engine import EngineArgs
from dynamo_cli.errors import ConfigError

from ..adapter import split_deterministic
from .args import server_args
from .engine import load_engine_class

NON_BLOCKING_ENV = "SGLANG_BLOCK_NONZERO_RANK_CHILDREN"


async def run_headless(args: EngineArgs, *, engine_cls: Any = None) -> None:
    """This node's schedulers of the group's engine, until cancelled (then SGLang is shut down)."""
    group = args.group
    if group.nnodes < 2 or group.node_rank < 1:
        raise ConfigError(f"SGLang's headless part is a follower's: got node {group.node_rank} of {group.nnodes}")
    args, is_deterministic = split_deterministic(args)
    kwargs = server_args(args, deterministic=is_deterministic)
    cls = engine_cls or load_engine_class()
    os.environ[NON_BLOCKING_ENV] = "0"  # read by SGLang in this process when the engine starts
    engine = await asyncio.to_thread(lambda: cls(**kwargs))
    try:
        await asyncio.Event().wait()
    finally:
        await asyncio.to_thread(engine.shutdown)
