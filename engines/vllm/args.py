"""Our `EngineArgs` as the keyword arguments of vLLM's `AsyncEngineArgs`: what a serving engine and a headless
follower node (headless.py) build alike, so every node of a multi-node engine runs the same configuration.

The options (`EngineArgs.extra`) pass straight through, checked against `AsyncEngineArgs`' fields. A group of
nodes (`EngineArgs.group`, `dyn worker --nnodes N --node-rank R`) becomes vLLM's multi-node settings without Ray:
`nnodes`, `node_rank`, `master_addr` (the leader's host) and the `mp` executor; `master_port` is vLLM's
(29501) unless the options give one (`--engine-arg master_port=...`, the same on every node).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dynamo_cli.engine import EngineArgs, NodeGroup
from dynamo_cli.errors import ConfigError
from dynamo_cli.model.paths import model_display_name, resolve_model_path

from ..adapter import local_or_hub
from ..hf_export import export_path, needs_export

EXTRA_ALIASES = {"num_gpu_blocks": "num_gpu_blocks_override"}
"""dyn's engine-neutral option names (`--num-gpu-blocks`) that vLLM spells differently."""
GROUP_KEYS = ("nnodes", "node_rank", "master_addr")
"""vLLM options that `dyn worker --nnodes/--node-rank/--leader-addr` set; the options may not set them too."""


def engine_kwargs(args: EngineArgs, engine_args_cls: Any, *, is_cpu: bool, has_lora: bool) -> dict[str, Any]:
    """`AsyncEngineArgs(**kwargs)` for `args`: the model (an exported GGUF's HF folder), prefix caching on,
    float32 on vLLM's CPU build, our block size, context length and adapters, the options, and the node group.
    ConfigError for an option vLLM has not, or one the group sets."""
    extra = {EXTRA_ALIASES.get(key, key): value for key, value in args.extra.items()}
    known = {f.name for f in dataclasses.fields(engine_args_cls)}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ConfigError(f"vLLM has no engine argument(s) {', '.join(unknown)}; see `vllm serve --help`")
    if needs_export(args.model):  # exported in start(): it takes seconds to minutes
        model = str(export_path(Path(resolve_model_path(args.model))))
    else:
        model = local_or_hub(args.model)
    kwargs: dict[str, Any] = {"model": model, "enable_prefix_caching": True}
    if is_cpu:
        kwargs["dtype"] = "float32"
    kwargs["served_model_name"] = args.served_model_name or (
        model_display_name(args.model) if needs_export(args.model) else Path(model).name
    )
    if args.block_size:
        kwargs["block_size"] = args.block_size
    if args.context_length:
        kwargs["max_model_len"] = args.context_length
    if args.max_loras > 0:
        if not has_lora:
            raise ConfigError("this vLLM has no LoRA support (vllm.lora.request); upgrade it, or serve no --lora")
        kwargs.update(enable_lora=True, max_loras=args.max_loras)
    kwargs.update(extra)
    kwargs.update(group_kwargs(args.group, extra))
    return kwargs


def group_kwargs(group: NodeGroup, extra: dict[str, Any]) -> dict[str, Any]:
    """vLLM's multi-node settings for `group` (none for a group of one): every node runs the `mp` executor, the
    followers' workers meet the leader's at `master_addr:master_port` (torch.distributed, gloo on a CPU)."""
    if group.nnodes == 1:
        return {}
    taken = sorted(key for key in GROUP_KEYS if key in extra)
    if taken:
        raise ConfigError(f"{', '.join(taken)}: set by --nnodes/--node-rank/--leader-addr; drop the engine arg")
    if int(extra.get("data_parallel_size", 1)) > 1:
        raise ConfigError(
            "data_parallel_size > 1 with --nnodes > 1: vLLM refuses data-parallel ranks across nodes for a dense "
            "model (external/hybrid load balancing); run one worker per node, or ranks on one node"
        )
    backend = extra.get("distributed_executor_backend", "mp")
    if backend != "mp":
        raise ConfigError(f"--nnodes > 1 runs vLLM's mp executor, not distributed_executor_backend={backend!r}")
    return {
        "nnodes": group.nnodes,
        "node_rank": group.node_rank,
        "master_addr": group.leader_host,
        "distributed_executor_backend": "mp",
    }
