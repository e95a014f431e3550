"""`dyn worker`: one engine registered on the planes, serving `generate`."""

from __future__ import annotations

from typing import Annotated

import typer

from dynamo_cli.cli import options as o
from dynamo_cli.config import WorkerConfig
from dynamo_cli.runtime.supervisor import die_with_parent, run
from dynamo_cli.runtime.transport import check_exposure
from dynamo_cli.worker import serve_worker


def command(
    engine: o.Engine = o.DEFAULTS["engine"],
    model: o.Model = o.DEFAULTS["model"],
    served_model_name: o.ServedName = None,
    role: Annotated[str, typer.Option("--role", envvar="DYN_ROLE", help="prefill | decode | both")] = "both",
    namespace: o.Namespace = o.DEFAULTS["namespace"],
    component: Annotated[
        str | None, typer.Option("--component", envvar="DYN_COMPONENT", help="Default: backend, or the role.")
    ] = None,
    endpoint: Annotated[str, typer.Option("--endpoint", envvar="DYN_ENDPOINT")] = "generate",
    host: Annotated[str, typer.Option("--host", envvar="DYN_WORKER_HOST", help="Request-plane address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", envvar="DYN_WORKER_PORT", help="Request-plane port (0: any).")] = 0,
    block_size: o.BlockSize = None,
    context_length: o.ContextLength = None,
    speedup_ratio: o.SpeedupRatio = None,
    num_gpu_blocks: o.NumGpuBlocks = None,
    max_num_seqs: o.MaxNumSeqs = None,
    deterministic: o.Deterministic = False,
    kv_host_cache_gb: o.KvHostCacheGb = 0.0,
    kv_disk_cache_gb: o.KvDiskCacheGb = 0.0,
    kv_disk_cache_dir: o.KvDiskCacheDir = None,
    kv_disk_offload_filter: o.KvDiskOffloadFilter = True,
    engine_arg: o.EngineArg = None,
    extra_engine_args: o.ExtraEngineArgs = None,
    graceful_shutdown: Annotated[
        float, typer.Option("--graceful-shutdown", envvar="DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS")
    ] = 5.0,
    discovery: o.Discovery = "embedded",
    events: o.Events = "embedded",
    lease_ttl: o.LeaseTtl = 10.0,
    cluster_secret_file: o.ClusterSecretFile = None,
    kv_transfer: o.KvTransfer = "auto",
    kv_transfer_port: Annotated[
        int, typer.Option("--kv-transfer-port", envvar="DYN_KV_TRANSFER_PORT", help="Prefill role (0: any).")
    ] = 0,
    kv_transfer_ttl: Annotated[
        float,
        typer.Option(
            "--kv-transfer-ttl", envvar="DYN_KV_TRANSFER_TTL", help="Prefill role: seconds unpulled KV is kept."
        ),
    ] = 30.0,
) -> None:
    """Run one worker: an engine that registers itself and serves `generate` until SIGTERM."""
    die_with_parent()
    secret = o.cluster_secret(cluster_secret_file)
    check_exposure(host, secret)  # before the engine loads: a refusal is immediate
    parsed_role = o.parse_role(role)
    extra = o.engine_extra(
        engine_arg,
        extra_engine_args,
        speedup_ratio=speedup_ratio,
        num_gpu_blocks=num_gpu_blocks,
        max_num_seqs=max_num_seqs,
        deterministic=deterministic or None,
    )
    config = WorkerConfig(
        engine=engine,
        model=model,
        served_model_name=served_model_name,
        namespace=namespace,
        component=component or ("backend" if parsed_role.value == "both" else parsed_role.value),
        endpoint=endpoint,
        role=parsed_role,
        host=host,
        port=port,
        block_size=block_size,
        context_length=context_length,
        graceful_shutdown_s=graceful_shutdown,
        planes=o.planes(discovery, events, lease_ttl, secret),
        extra=extra,
        kv_transfer=kv_transfer,
        kv_transfer_port=kv_transfer_port,
        kv_transfer_ttl_s=kv_transfer_ttl,
        kv_tiers=o.kv_tiers(kv_host_cache_gb, kv_disk_cache_gb, kv_disk_cache_dir, kv_disk_offload_filter),
    )
    run(serve_worker(config))
