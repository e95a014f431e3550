"""`dyn serve`: a whole deployment (frontend, router, workers) with one command."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from dynamo_cli.cli import options as o
from dynamo_cli.config import AuthConfig, FrontendConfig, ServeConfig, TlsConfig, WorkerConfig, read_api_keys
from dynamo_cli.engine import Role
from dynamo_cli.errors import ConfigError
from dynamo_cli.frontend.tools.parsers import check_parsers
from dynamo_cli.launcher import ServePlan, serve_all
from dynamo_cli.planner.planner import INTERVAL_S, LOAD_INTERVAL_S, STARTUP_HELP, STARTUP_S, PlannerConfig
from dynamo_cli.planner.service import PlanRun, check_run
from dynamo_cli.planner.sizing import Bounds, Targets
from dynamo_cli.runtime.supervisor import run


def command(
    model: o.Model = o.DEFAULTS["model"],
    engine: o.Engine = "llamacpp",
    workers: Annotated[
        int, typer.Option("--workers", "-n", envvar="DYN_WORKERS", help="Worker processes (0: frontend only).")
    ] = 1,
    router: Annotated[
        str, typer.Option("--router", envvar="DYN_ROUTER_MODE", help="round-robin | random | kv")
    ] = "round-robin",
    routers: Annotated[
        int,
        typer.Option("--routers", envvar="DYN_ROUTERS", help="With --router remote: `dyn router` replicas to start."),
    ] = 0,
    disagg: Annotated[
        bool,
        typer.Option(
            "--disagg",
            envvar="DYN_DISAGG",
            help="Disaggregated serving: prefill workers and decode workers (see --disagg-policy).",
        ),
    ] = False,
    prefill_workers: Annotated[
        int, typer.Option("--prefill-workers", envvar="DYN_PREFILL_WORKERS", help="With --disagg (default 1).")
    ] = 1,
    decode_workers: Annotated[
        int | None,
        typer.Option("--decode-workers", envvar="DYN_DECODE_WORKERS", help="With --disagg (default: --workers)."),
    ] = None,
    disagg_policy: o.DisaggPolicy = o._D.policy,
    max_local_prefill_length: o.MaxLocalPrefill = o._D.max_local_prefill_length,
    max_prefill_queue: o.MaxPrefillQueue = o._D.max_prefill_queue,
    decode_busy_threshold: o.DecodeBusy = o._D.decode_busy_threshold,
    enforce_disagg: o.EnforceDisagg = False,
    prefill_router_mode: o.PrefillRouterMode = None,
    router_queue_size: o.QueueSize = o._Q.max_size,
    router_queue_timeout: o.QueueTimeout = o._Q.max_wait_s,
    router_queue_policy: o.QueuePolicyOption = o._Q.policy.value,
    kv_transfer: o.KvTransfer = "auto",
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
    host: Annotated[str, typer.Option("--host", envvar="DYN_HTTP_HOST")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", "-p", envvar="DYN_HTTP_PORT", help="HTTP port (0: any free port).")
    ] = 8000,
    served_model_name: o.ServedName = None,
    namespace: o.Namespace = o.DEFAULTS["namespace"],
    migration_limit: Annotated[int, typer.Option("--migration-limit", envvar="DYN_MIGRATION_LIMIT")] = 3,
    http_server: Annotated[
        str, typer.Option("--http-server", envvar="DYN_HTTP_SERVER", help="uvicorn | hypercorn")
    ] = "uvicorn",
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
    discovery: o.Discovery = "embedded",
    events: o.Events = "embedded",
    lease_ttl: o.LeaseTtl = 10.0,
    max_inflight_per_worker: o.MaxInflightPerWorker = 0,
    active_blocks_threshold: o.ActiveBlocksThreshold = 1.0,
    api_key: Annotated[
        list[str] | None,
        typer.Option("--api-key", help="Accepted API key (repeatable); else DYN_API_KEYS (comma-separated)."),
    ] = None,
    api_key_file: Annotated[
        str | None, typer.Option("--api-key-file", envvar="DYN_API_KEY_FILE", help="File of API keys, one a line.")
    ] = None,
    api_key_rps: Annotated[
        float, typer.Option("--api-key-rps", envvar="DYN_API_KEY_RPS", help="Requests/s per key (0: no limit).")
    ] = 0.0,
    api_key_max_inflight: Annotated[
        int,
        typer.Option(
            "--api-key-max-inflight",
            envvar="DYN_API_KEY_MAX_INFLIGHT",
            help="Requests in flight per key (0: no limit).",
        ),
    ] = 0,
    metrics_require_key: Annotated[
        bool, typer.Option("--metrics-require-key", envvar="DYN_METRICS_REQUIRE_KEY", help="/metrics needs a key.")
    ] = False,
    tls_cert_file: Annotated[
        str | None, typer.Option("--tls-cert-file", envvar="DYN_TLS_CERT_FILE", help="PEM certificate: serve HTTPS.")
    ] = None,
    tls_key_file: Annotated[
        str | None, typer.Option("--tls-key-file", envvar="DYN_TLS_KEY_FILE", help="PEM private key of the cert.")
    ] = None,
    tls_ca_file: Annotated[
        str | None,
        typer.Option("--tls-ca-file", envvar="DYN_TLS_CA_FILE", help="PEM CA: require client certificates (mTLS)."),
    ] = None,
    body_limit_mb: Annotated[float, typer.Option("--body-limit-mb", envvar="DYN_HTTP_BODY_LIMIT_MB")] = 45.0,
    ready_timeout: Annotated[float, typer.Option("--ready-timeout", envvar="DYN_READY_TIMEOUT")] = 300.0,
    max_restarts: Annotated[
        int,
        typer.Option(
            "--max-restarts",
            envvar="DYN_MAX_RESTARTS",
            help="Restarts of a worker that exits unexpectedly, within 5 minutes (0: never).",
        ),
    ] = 5,
    cluster_secret_file: o.ClusterSecretFile = None,
    tool_call_parser: Annotated[
        str,
        typer.Option(
            "--tool-call-parser",
            envvar="DYN_TOOL_CALL_PARSER",
            help="auto | hermes | llama3_json | mistral | pythonic | json: model text → tool_calls.",
        ),
    ] = "auto",
    planner: Annotated[
        bool,
        typer.Option(
            "--planner",
            envvar="DYN_PLANNER",
            help="Run the SLA planner in this process: it "
            "scales the workers to --planner-ttft/--planner-itl (--workers: the initial count).",
        ),
    ] = False,
    planner_ttft: Annotated[float, o.planner_option("--ttft", "TTFT target (ms).", prefix="planner-")] = 0.0,
    planner_itl: Annotated[float, o.planner_option("--itl", "ITL target (ms).", prefix="planner-")] = 0.0,
    planner_profile: Annotated[
        Path | None,
        o.planner_option(
            "--profile",
            "Profile JSON (`dyn plan profile`; default for the mocker: profiled at startup, a few seconds).",
            prefix="planner-",
        ),
    ] = None,
    planner_min_workers: Annotated[int, o.planner_option("--min-workers", "Per pool.", prefix="planner-")] = 1,
    planner_max_workers: Annotated[int, o.planner_option("--max-workers", "Per pool.", prefix="planner-")] = 8,
    planner_interval: Annotated[
        float, o.planner_option("--interval", "Throughput step period (s).", prefix="planner-")
    ] = INTERVAL_S,
    planner_load_interval: Annotated[
        float, o.planner_option("--load-interval", "Burst check period (s; 0: off).", prefix="planner-")
    ] = LOAD_INTERVAL_S,
    planner_startup: Annotated[float, o.planner_option("--startup", STARTUP_HELP, prefix="planner-")] = STARTUP_S,
    reasoning_parser: Annotated[
        str | None,
        typer.Option(
            "--reasoning-parser",
            envvar="DYN_REASONING_PARSER",
            help="basic | qwen3 | deepseek_r1: <think> text → reasoning_content (default: none).",
        ),
    ] = None,
) -> None:
    """Serve a model: OpenAI HTTP frontend + router + N workers, on one machine with no external service."""
    if workers < 0:
        raise ConfigError(f"--workers must be >= 0, got {workers}")
    if disagg and (prefill_workers < 1 or (decode_workers is not None and decode_workers < 1)):
        raise ConfigError(
            f"--disagg needs --prefill-workers >= 1 and --decode-workers >= 1, got "
            f"{prefill_workers} and {decode_workers}"
        )
    num_decode = (decode_workers if decode_workers is not None else workers) if disagg else workers
    if routers < 0 or (routers and router != "remote"):
        raise ConfigError(f"--routers {routers} needs --router remote and a count >= 0")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}")
    if migration_limit < 0:
        raise ConfigError(f"--migration-limit must be >= 0, got {migration_limit}")
    check_parsers(tool_call_parser, reasoning_parser)
    plan = None
    if planner:
        plan = _plan(
            engine,
            disagg,
            routers,
            planner_ttft,
            planner_itl,
            planner_profile,
            Bounds(planner_min_workers, planner_max_workers),
            planner_interval,
            planner_load_interval,
            planner_startup,
        )
        clamp = (max(planner_min_workers, min(planner_max_workers, n)) for n in (num_decode, prefill_workers))
        num_decode, prefill_workers = clamp
    # The request plane's secret: the one given (multi-node), else a new one for this deployment only.
    planes = o.planes(discovery, events, lease_ttl, o.cluster_secret(cluster_secret_file, make=True))
    extra = o.engine_extra(
        engine_arg,
        extra_engine_args,
        speedup_ratio=speedup_ratio,
        num_gpu_blocks=num_gpu_blocks,
        max_num_seqs=max_num_seqs,
        deterministic=deterministic or None,
    )
    worker = WorkerConfig(
        engine=engine,
        model=model,
        served_model_name=served_model_name,
        namespace=namespace,
        role=Role.DECODE if disagg else Role.BOTH,
        block_size=block_size,
        context_length=context_length,
        planes=planes,
        extra=extra,
        kv_transfer=kv_transfer,
        kv_tiers=o.kv_tiers(kv_host_cache_gb, kv_disk_cache_gb, kv_disk_cache_dir, kv_disk_offload_filter),
    )
    frontend = FrontendConfig(
        host=host,
        port=port,
        namespace=namespace,
        router=router,
        http_server=http_server,
        migration_limit=migration_limit,
        planes=planes,
        kv_router=o.kv_router(
            block_size,
            kv_overlap_score_weight,
            router_temperature,
            kv_events,
            hot_spot_guard,
            router_ttl,
            router_cost,
            router_prefill_tps,
            router_tier_weights,
            router_host_bandwidth_gbs,
            router_disk_bandwidth_gbs,
        ),
        max_body_bytes=int(body_limit_mb * 1024 * 1024),
        max_inflight_per_worker=max_inflight_per_worker,
        disagg=o.disagg(
            disagg_policy,
            max_local_prefill_length,
            max_prefill_queue,
            decode_busy_threshold,
            enforce_disagg,
            prefill_router_mode,
        ),
        active_blocks_threshold=active_blocks_threshold,
        queue=o.queue(router_queue_size, router_queue_timeout, router_queue_policy),
        auth=AuthConfig(
            read_api_keys(api_key or [], api_key_file, os.environ),
            api_key_rps,
            api_key_max_inflight,
            metrics_require_key,
        ),
        tls=TlsConfig(tls_cert_file, tls_key_file, tls_ca_file),
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
    )
    run(
        serve_all(
            ServeConfig(
                frontend=frontend,
                worker=worker,
                num_workers=num_decode,
                num_prefill_workers=prefill_workers if disagg else 0,
                num_routers=routers,
                ready_timeout_s=ready_timeout,
                max_restarts=max_restarts,
            ),
            plan,
        )
    )


def _plan(
    engine: str,
    disagg: bool,
    routers: int,
    ttft: float,
    itl: float,
    profile: Path | None,
    bounds: Bounds,
    interval: float,
    load_interval: float,
    startup: float,
) -> ServePlan:
    """`--planner`'s flags checked as `dyn plan run` checks its own."""
    if profile is None and engine != "mocker":
        raise ConfigError(
            f"--planner with --engine {engine} needs --planner-profile FILE (from `dyn plan profile "
            f"--engine {engine}`); only the mocker is profiled on the fly"
        )
    if routers:
        raise ConfigError("--planner does not run with --routers yet; use `dyn plan run` beside the deployment")
    config = PlannerConfig(
        targets=Targets(ttft, itl),
        bounds=bounds,
        mode="disagg" if disagg else "agg",
        interval_s=interval,
        load_interval_s=load_interval,
        startup_s=startup,
    )
    check_run(PlanRun(planner=config, frontends=("in-process",), namespace="serve", discovery="embedded"))
    return ServePlan(config=config, profile=profile)
