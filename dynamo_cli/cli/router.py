"""`dyn router`: one standalone KV router replica, serving `generate` and `best_worker_id`."""

from __future__ import annotations

from typing import Any

from dynamo_cli.cli import options as o
from dynamo_cli.cli import settings
from dynamo_cli.config import PlanesConfig, RouterConfig, config_document
from dynamo_cli.router.service import serve_router
from dynamo_cli.runtime.supervisor import announce, die_with_parent, run
from dynamo_cli.runtime.transport import check_exposure
from dynamo_cli.tracing.logs import use_log_format

KNOBS = settings.knobs(RouterConfig, skip={"DisaggConfig.prefill_router_mode", "DisaggConfig.first_token"})


def _command(**values: Any) -> None:
    """Run one KV router replica: routes `{ns}/router/generate` to the backends, sharing load with peers."""
    die_with_parent()
    config = config_document(RouterConfig) or _from_flags(values)  # `dyn serve`'s children get a document
    use_log_format(config.telemetry.log_format)
    check_exposure(config.host, config.planes.cluster_secret)
    run(serve_router(config, announce))


def _from_flags(values: dict[str, Any]) -> RouterConfig:
    secret = o.cluster_secret(values.pop("cluster_secret_file"))
    return settings.build(RouterConfig, values, KNOBS, {(PlanesConfig, "cluster_secret"): secret})


command = settings.command(_command, KNOBS, [settings.option("cluster_secret_file", o.ClusterSecretFile, None)])
