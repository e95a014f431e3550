"""`dyn worker`: one engine registered on the planes, serving `generate`."""

from __future__ import annotations

from typing import Any

from dynamo_cli.cli import options as o
from dynamo_cli.cli import settings
from dynamo_cli.config import PlanesConfig, WorkerConfig, config_document
from dynamo_cli.runtime.supervisor import die_with_parent, run
from dynamo_cli.runtime.transport import check_exposure
from dynamo_cli.tracing.logs import use_log_format
from dynamo_cli.worker import serve_worker

KNOBS = settings.knobs(WorkerConfig, help=o.HELP)


def _command(**values: Any) -> None:
    """Run one worker: an engine that registers itself and serves `generate` until SIGTERM."""
    die_with_parent()
    config = config_document(WorkerConfig) or _from_flags(values)  # `dyn serve`'s children get a document
    use_log_format(config.telemetry.log_format)
    check_exposure(config.host, config.planes.cluster_secret)  # before the engine loads: a refusal is immediate
    run(serve_worker(config))


def _from_flags(values: dict[str, Any]) -> WorkerConfig:
    extra = o.engine_options(values)
    secret = o.cluster_secret(values.pop("cluster_secret_file"))
    given = {(WorkerConfig, "extra"): extra, (PlanesConfig, "cluster_secret"): secret}
    return settings.build(WorkerConfig, values, KNOBS, given)


command = settings.command(
    _command, KNOBS, [*o.ENGINE_OPTIONS, settings.option("cluster_secret_file", o.ClusterSecretFile, None)]
)
