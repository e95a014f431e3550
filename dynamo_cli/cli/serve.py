"""`dyn serve`: a whole deployment (frontend, router, workers) with one command."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from dynamo_cli.backend_file import read_backends
from dynamo_cli.cli import options as o
from dynamo_cli.cli import settings
from dynamo_cli.config import (
    DEFAULT_ENGINE,
    AuthConfig,
    PlanesConfig,
    ServeConfig,
    TenantConfig,
    WorkerConfig,
    backend_options,
    config_document,
    read_api_keys,
)
from dynamo_cli.engine import Role
from dynamo_cli.errors import ConfigError
from dynamo_cli.frontend.kserve import check_kserve
from dynamo_cli.frontend.tools.parsers import check_parsers
from dynamo_cli.launcher import ServePlan, serve_all
from dynamo_cli.planner.planner import PlannerConfig, log_decisions
from dynamo_cli.planner.service import PlanRun, check_run
from dynamo_cli.runtime.supervisor import die_with_parent, run
from dynamo_cli.settings import DISAGG, ESSENTIAL
from dynamo_cli.tracing import check_tracing
from dynamo_cli.tracing.logs import use_log_format

SKIP = frozenset(
    {
        "WorkerConfig.host",
        "WorkerConfig.port",
        "WorkerConfig.component",
        "WorkerConfig.endpoint",
        "WorkerConfig.role",
        "WorkerConfig.kv_transfer_port",
        "GroupConfig.nnodes",
        "GroupConfig.node_rank",
        "GroupConfig.leader_addr",
    }
)
"""The workers' own address, name and role: dyn serve places them (the HTTP --host/--port are the frontend's)."""
KNOBS = settings.knobs(ServeConfig, skip=SKIP, help=o.HELP)


PLANNER_PANEL = "Planner (scales the workers to TTFT/ITL targets)"
PLANNER_KNOBS = settings.knobs(PlannerConfig, skip={"PlannerConfig.mode"}, prefix="planner-", panel=PLANNER_PANEL)
"""`dyn plan run`'s planner settings as `--planner-*` (the mode is --disagg's)."""


EXTRA = [
    settings.option(
        "disagg",
        Annotated[
            bool,
            typer.Option(
                "--disagg",
                envvar="DYN_DISAGG",
                help="Disaggregated serving: prefill workers and decode workers (see --disagg-policy).",
                rich_help_panel=ESSENTIAL,
            ),
        ],
        False,
    ),
    settings.option(
        "prefill_workers",
        Annotated[
            int,
            typer.Option(
                "--prefill-workers",
                envvar="DYN_PREFILL_WORKERS",
                help="With --disagg (default: 1).",
                rich_help_panel=DISAGG,
            ),
        ],
        None,
    ),
    settings.option(
        "decode_workers",
        Annotated[
            int | None,
            typer.Option(
                "--decode-workers",
                envvar="DYN_DECODE_WORKERS",
                help="With --disagg (default: --workers).",
                rich_help_panel=DISAGG,
            ),
        ],
        None,
    ),
    *o.ENGINE_OPTIONS,
    *o.API_KEY_OPTIONS,
    settings.option("cluster_secret_file", o.ClusterSecretFile, None),
    settings.option(
        "planner",
        Annotated[
            bool,
            typer.Option(
                "--planner",
                envvar="DYN_PLANNER",
                help="Run the SLA planner in this process: it scales the workers to --planner-ttft/--planner-itl "
                "(--workers: the initial count).",
                rich_help_panel=PLANNER_PANEL,
            ),
        ],
        False,
    ),
    settings.option(
        "planner_profile",
        Annotated[
            Path | None,
            o.planner_option(
                "--profile",
                "Profile JSON (`dyn plan profile`; default for the mocker: profiled at startup, a few seconds).",
                prefix="planner-",
            ),
        ],
        None,
    ),
]


def _command(**values: Any) -> None:
    """Serve a model: OpenAI HTTP frontend + router + N workers, on one machine with no external service."""
    child = config_document(ServeConfig)  # one of the other frontends of `dyn serve --frontends N`
    if child is not None:
        die_with_parent()
        use_log_format(child.frontend.telemetry.log_format)
        return run(serve_all(child))
    secret = o.cluster_secret(values.pop("cluster_secret_file"), make=True)  # the given one, else a new one
    keys = read_api_keys(values.pop("api_key") or [], values.pop("api_key_file"), os.environ)
    given = {
        (PlanesConfig, "cluster_secret"): secret,
        (AuthConfig, "api_keys"): keys.keys,
        (AuthConfig, "admin_keys"): keys.admins,
        (TenantConfig, "key_tenants"): keys.tenants,
    }
    config, plan = deployment(values, given)
    check_tracing(config.frontend.telemetry)  # said once here, not by each process it starts
    check_kserve(config.frontend)
    use_log_format(config.frontend.telemetry.log_format)
    if plan is not None:  # its scaling decisions are logged at INFO (the default level is WARNING)
        log_decisions()
    run(serve_all(config, plan))


def deployment(
    values: dict[str, Any],
    given: dict[tuple[type, str], Any],
    knobs: list[settings.Knob] = KNOBS,
    *,
    in_process: bool = True,
) -> tuple[ServeConfig, ServePlan | None]:
    """The deployment the flags (`knobs`' values) describe (`given`: fields set by the caller: the secrets, and for
    `dyn k8s render` the planes and namespace), and its planner (`--planner`; `in_process`: inside `dyn serve`)."""
    disagg, prefill, decode = values.pop("disagg"), values.pop("prefill_workers"), values.pop("decode_workers")
    if not disagg and (prefill is not None or decode is not None):
        flag = "--prefill-workers" if prefill is not None else "--decode-workers"
        raise ConfigError(f"{flag} needs --disagg (without it every worker both prefills and decodes: --workers)")
    prefill = 1 if prefill is None else prefill
    if disagg and (prefill < 1 or (decode is not None and decode < 1)):
        raise ConfigError(
            f"--disagg needs --prefill-workers >= 1 and --decode-workers >= 1, got {prefill} and {decode}"
        )
    num_decode = (decode if decode is not None else values["workers"]) if disagg else values["workers"]
    backends = _backends(values, disagg)
    check_parsers(values["tool_call_parser"], values["reasoning_parser"])
    plan = _plan(values, disagg, num_decode, prefill, in_process)
    if plan is not None:  # the pools start inside the planner's bounds
        bounds = plan.config.bounds
        num_decode, prefill = (max(bounds.min_workers, min(bounds.max_workers, n)) for n in (num_decode, prefill))
    given = {
        **given,
        (WorkerConfig, "extra"): o.engine_options(values),
        (WorkerConfig, "role"): Role.DECODE if disagg else Role.BOTH,
        (WorkerConfig, "component"): "backend",  # decode workers too: `dyn router --component`'s default
        (ServeConfig, "num_workers"): num_decode,
        (ServeConfig, "num_prefill_workers"): prefill if disagg else 0,
    }
    if backends is not None:  # one http-engine worker each; one that publishes no KV events is routed approximately
        given[(WorkerConfig, "engine")] = "http"
        given[(ServeConfig, "num_workers")] = 0 if values.get("backend_file") else len(backends)
    return settings.build(ServeConfig, values, knobs, given), plan


def _backends(values: dict[str, Any], disagg: bool) -> list[str] | None:
    """The `--backend` specs (`--backend-file`'s now, each started by the launcher's watch), when the flags around
    them fit (each backend prefills and decodes itself); None: no backends, dyn's own workers."""
    backends, path = list(values.get("backend") or []), values.get("backend_file")
    if path and backends:
        raise ConfigError("--backend-file lists the backends: drop --backend")
    if not backends and not path:
        return None
    if disagg or values["engine"] not in (DEFAULT_ENGINE, "http"):
        flag = "--disagg" if disagg else f"--engine {values['engine']}"
        raise ConfigError(f"--backend routes to engine servers that run on their own: drop {flag}")
    for spec in backends:
        backend_options(spec)  # a malformed one is refused here, not by its worker
    return read_backends(Path(path)) if path else backends


def _plan(
    values: dict[str, Any], disagg: bool, num_decode: int, num_prefill: int, in_process: bool
) -> ServePlan | None:
    """`--planner`'s flags checked as `dyn plan run` checks its own (`in_process`: and as `dyn serve` runs it)."""
    options = {name: values.pop(name) for name in list(values) if name.startswith("planner")}
    if not options["planner"]:
        return None
    engine = values["engine"]
    if options["planner_profile"] is None and (engine != "mocker" or not in_process):
        raise ConfigError(
            f"--planner with --engine {engine} needs --planner-profile FILE (from `dyn plan profile "
            f"--engine {engine}`); only `dyn serve` profiles the mocker on the fly"
        )
    if values["routers"] and in_process:
        raise ConfigError("--planner does not run with --routers yet; use `dyn plan run` beside the deployment")
    config = settings.build(
        PlannerConfig, options, PLANNER_KNOBS, {(PlannerConfig, "mode"): "disagg" if disagg else "agg"}
    )
    check_run(PlanRun(planner=config, frontends=("in-process",), namespace="serve", discovery="embedded"))
    return ServePlan(config=config, profile=options["planner_profile"])


command = settings.command(_command, [*KNOBS, *PLANNER_KNOBS], EXTRA)
