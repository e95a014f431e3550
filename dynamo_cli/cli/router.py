"""`dyn router`: one standalone KV router replica, serving `generate` and `best_worker_id`."""

from __future__ import annotations

from typing import Annotated

import typer

from dynamo_cli.cli import options as o
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
    host: Annotated[
        str, typer.Option("--host", envvar="DYN_ROUTER_HOST", help="Request-plane address.")
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", envvar="DYN_ROUTER_PORT", help="Request-plane port (0: any).")
    ] = 0,
    block_size: o.BlockSize = None,
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
) -> None:
    """Run one KV router replica: routes `{ns}/router/generate` to the backends, sharing load with peers."""
    die_with_parent()
    secret = o.cluster_secret(cluster_secret_file)
    check_exposure(host, secret)
    weight, temperature = kv_overlap_score_weight, router_temperature
    kv_router = o.kv_router(block_size, weight, temperature, kv_events, hot_spot_guard, router_ttl)
    config = RouterServiceConfig(namespace=namespace, component=component, host=host, port=port,
                                 kv_router=kv_router, graceful_shutdown_s=graceful_shutdown,
                                 planes=o.planes(discovery, events, lease_ttl, secret))  # fmt: skip
    run(serve_router(config, lambda line: typer.echo(line)))
