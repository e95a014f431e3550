"""`dyn router`: one standalone KV router replica, serving `generate` and `best_worker_id`."""

from __future__ import annotations

from typing import Annotated

import typer

from dynamo_cli.cli import options as o
from dynamo_cli.router.registry import BusyThresholds
from dynamo_cli.router.service import RouterServiceConfig, serve_router
from dynamo_cli.runtime.supervisor import die_with_parent, run
from dynamo_cli.runtime.transport import check_exposure


def command(
    namespace: o.Namespace = o.DEFAULTS["namespace"],
    component: Annotated[
        str,
        typer.Option(
            "--component",
            envvar="DYN_ROUTER_BACKEND_COMPONENT",
            help="Component of the backend workers to route to.",
        ),
    ] = "backend",
    host: Annotated[str, typer.Option("--host", envvar="DYN_ROUTER_HOST", help="Request-plane address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", envvar="DYN_ROUTER_PORT", help="Request-plane port (0: any).")] = 0,
    block_size: o.BlockSize = None,
    router_cost: o.RouterCost = o.KV_ROUTER.cost,
    router_prefill_tps: o.RouterPrefillTps = o.KV_ROUTER.prefill_tokens_per_s,
    router_tier_weights: o.RouterTierWeights = "",
    router_host_bandwidth_gbs: o.RouterHostGbs = o.KV_ROUTER.host_bandwidth_gbs,
    router_disk_bandwidth_gbs: o.RouterDiskGbs = o.KV_ROUTER.disk_bandwidth_gbs,
    kv_overlap_score_weight: o.OverlapWeight = o.KV_ROUTER.overlap_score_weight,
    router_temperature: o.RouterTemperature = o.KV_ROUTER.temperature,
    kv_events: o.KvEvents = o.KV_ROUTER.use_kv_events,
    hot_spot_guard: o.HotSpotGuard = o.KV_ROUTER.hot_spot_guard,
    router_ttl: o.RouterTtl = o.KV_ROUTER.approx_ttl_s,
    graceful_shutdown: Annotated[
        float, typer.Option("--graceful-shutdown", envvar="DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS")
    ] = 5.0,
    discovery: o.Discovery = "embedded",
    events: o.Events = "embedded",
    lease_ttl: o.LeaseTtl = 10.0,
    cluster_secret_file: o.ClusterSecretFile = None,
    prefill_component: Annotated[
        str,
        typer.Option(
            "--prefill-component",
            envvar="DYN_ROUTER_PREFILL_COMPONENT",
            help="Component of the prefill workers (disaggregation).",
        ),
    ] = "prefill",
    disagg_policy: o.DisaggPolicy = o._D.policy,
    max_local_prefill_length: o.MaxLocalPrefill = o._D.max_local_prefill_length,
    max_prefill_queue: o.MaxPrefillQueue = o._D.max_prefill_queue,
    decode_busy_threshold: o.DecodeBusy = o._D.decode_busy_threshold,
    enforce_disagg: o.EnforceDisagg = False,
    router_queue_size: o.QueueSize = o._Q.max_size,
    router_queue_timeout: o.QueueTimeout = o._Q.max_wait_s,
    router_queue_policy: o.QueuePolicyOption = o._Q.policy.value,
    max_inflight_per_worker: o.MaxInflightPerWorker = 0,
    active_blocks_threshold: o.ActiveBlocksThreshold = 1.0,
) -> None:
    """Run one KV router replica: routes `{ns}/router/generate` to the backends, sharing load with peers."""
    die_with_parent()
    secret = o.cluster_secret(cluster_secret_file)
    check_exposure(host, secret)
    weight, temperature = kv_overlap_score_weight, router_temperature
    kv_router = o.kv_router(
        block_size,
        weight,
        temperature,
        kv_events,
        hot_spot_guard,
        router_ttl,
        router_cost,
        router_prefill_tps,
        router_tier_weights,
        router_host_bandwidth_gbs,
        router_disk_bandwidth_gbs,
    )
    config = RouterServiceConfig(
        namespace=namespace,
        component=component,
        host=host,
        port=port,
        kv_router=kv_router,
        graceful_shutdown_s=graceful_shutdown,
        planes=o.planes(discovery, events, lease_ttl, secret),
        prefill_component=prefill_component,
        disagg=o.disagg(
            disagg_policy, max_local_prefill_length, max_prefill_queue, decode_busy_threshold, enforce_disagg, None
        ),
        busy=BusyThresholds(max_inflight_per_worker, active_blocks_threshold),
        queue=o.queue(router_queue_size, router_queue_timeout, router_queue_policy),
    )
    run(serve_router(config, lambda line: typer.echo(line)))
