"""Our `EngineArgs` as SGLang's `ServerArgs` keywords: what a serving engine and a headless follower node build
alike, with SGLang's data-parallel ranks and its multi-node settings.

Ranks: `data_parallel_size=N` (the engine-neutral option, as vLLM's and the mocker's) is SGLang's attention data
parallelism, `dp_size=N` with `enable_dp_attention`: a scheduler and a KV cache per rank, each rank's KV events
from a publisher of its own at the endpoint's port + rank, stamped with its `attn_dp_rank`. Attention DP splits the
tensor-parallel ranks, so `tp_size` defaults to N and must divide by it. SGLang's own `dp_size` with
`enable_dp_attention` counts the same; `dp_size` without it (independent replicas behind SGLang's controller,
whose publishers all say rank 0) stays one rank to the router. A group of nodes (`dyn worker --nnodes`) becomes
`nnodes`, `node_rank` and `dist_init_addr` (the leader's host, port 29500 unless the options give their own
`dist_init_addr`, the same on every node).
"""

from __future__ import annotations

from typing import Any

from dynamo_cli.engine import EngineArgs, NodeGroup, Role
from dynamo_cli.errors import ConfigError

from ..adapter import local_or_hub

DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_LORA_RANK = 16
"""`max_lora_rank` unless the options say (vLLM's default): SGLang sizes its adapter buffers at start."""
OUR_KEYS = ("bootstrap_host",)
"""Options of ours, not SGLang's (the engine reads them)."""
DIST_INIT_PORT = 29500
"""The leader's torch.distributed port of a multi-node SGLang engine (Dynamo's operator uses the same)."""


def server_args(args: EngineArgs, *, deterministic: bool) -> dict[str, Any]:
    """`sglang.Engine(**kwargs)` for `args`: token ids in and out, our page size, context length and adapters, the
    options, the disaggregation role, the ranks and the node group (the serving engine adds its KV events and a
    prefill engine's bootstrap port)."""
    page_size = args.block_size or DEFAULT_BLOCK_SIZE
    kwargs: dict[str, Any] = {"model_path": local_or_hub(args.model), "page_size": page_size}
    if args.served_model_name:
        kwargs["served_model_name"] = args.served_model_name
    if args.context_length:
        kwargs["context_length"] = args.context_length
    if args.max_loras > 0:
        kwargs.update(enable_lora=True, max_loras_per_batch=args.max_loras)
        if "lora_paths" not in args.extra:  # else SGLang infers the rank and modules from those adapters
            kwargs.update(max_lora_rank=DEFAULT_MAX_LORA_RANK, lora_target_modules=["all"])
    extra = {key: value for key, value in args.extra.items() if key not in OUR_KEYS}
    kwargs.update(dp_kwargs(extra.pop("data_parallel_size", None), extra))
    kwargs.update(extra)
    if deterministic:
        kwargs["enable_deterministic_inference"] = True  # SGLang's batch-invariant ops
    kwargs.update(skip_tokenizer_init=True, stream_output=True)
    if args.role is not Role.BOTH:
        kwargs["disaggregation_mode"] = args.role.value
        kwargs.setdefault("disaggregation_transfer_backend", "nixl")
    kwargs.update(group_kwargs(args.group, extra))
    return kwargs


def dp_kwargs(size: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """SGLang's attention DP for `data_parallel_size` (None: not asked for); ConfigError for a size SGLang would
    refuse, or one given twice."""
    if size is None:
        return {}
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"sglang option data_parallel_size must be a positive integer, got {size!r}")
    if "dp_size" in extra:
        raise ConfigError("give data_parallel_size or SGLang's dp_size, not both")
    tp_size = extra.get("tp_size", size)
    if not isinstance(tp_size, int) or tp_size % size:
        raise ConfigError(
            f"sglang: attention DP splits the tensor-parallel ranks: tp_size ({tp_size}) must divide by "
            f"data_parallel_size ({size})"
        )
    return {"dp_size": size, "enable_dp_attention": size > 1, "tp_size": tp_size}


def num_ranks(kwargs: dict[str, Any]) -> int:
    """The routing targets of an engine of these server args: its attention-DP ranks, else one."""
    size = kwargs.get("dp_size", 1)
    return int(size) if kwargs.get("enable_dp_attention") and isinstance(size, int) and size > 1 else 1


def group_kwargs(group: NodeGroup, extra: dict[str, Any]) -> dict[str, Any]:
    """SGLang's multi-node settings for `group` (none for a group of one)."""
    if group.nnodes == 1:
        return {}
    taken = sorted(key for key in ("nnodes", "node_rank") if key in extra)
    if taken:
        raise ConfigError(f"{', '.join(taken)}: set by --nnodes/--node-rank; drop the engine arg")
    dist_init_addr = extra.get("dist_init_addr") or f"{group.leader_host}:{DIST_INIT_PORT}"
    return {"nnodes": group.nnodes, "node_rank": group.node_rank, "dist_init_addr": dist_init_addr}
