"""`dyn plan`: profile an engine (`dyn plan profile`) and scale a deployment to SLO targets (`dyn plan run`)."""

from __future__ import annotations

import asyncio
import inspect
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn

from dynamo_cli.cli import options as o
from dynamo_cli.cli import settings
from dynamo_cli.config import DEFAULT_MODEL, DEFAULT_NAMESPACE, PlanesConfig, WorkerConfig, child_command
from dynamo_cli.config.telemetry import SYSTEM_PORT
from dynamo_cli.engine import EngineArgs, Role, load_engine
from dynamo_cli.errors import ConfigError
from dynamo_cli.planner.kubernetes import KubernetesConfig
from dynamo_cli.planner.planner import INTERVAL_S, LOAD_INTERVAL_S, STARTUP_S, PlannerConfig, Step
from dynamo_cli.planner.predictors import PREDICTORS
from dynamo_cli.planner.profile import Profile, load_profile, save_profile
from dynamo_cli.planner.profiler import Sweep, profile_engine
from dynamo_cli.planner.service import PlanRun, check_run, serve_planner
from dynamo_cli.planner.sizing import Bounds, Targets
from dynamo_cli.runtime.supervisor import PARENT_ENV, announce
from dynamo_cli.runtime.supervisor import run as run_loop

app = typer.Typer(
    help="SLA planner: profile an engine, then scale prefill and decode workers to TTFT/ITL targets.",
    no_args_is_help=True,
)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"{flag} '{text}' must be comma-separated integers") from None
    if not values or min(values) <= 0:
        raise ConfigError(f"{flag} '{text}' must list positive integers")
    return values


def _statics(text: str, mode: str) -> list[int | tuple[int, int]]:
    """`--static`: worker counts (agg) or PREFILL+DECODE pairs (disagg)."""
    if mode != "disagg":
        return list(_ints(text, "--static"))
    try:
        pairs = [tuple(int(n) for n in part.split("+")) for part in text.split(",") if part.strip()]
    except ValueError:
        pairs = []
    if not pairs or not all(len(p) == 2 and min(p) > 0 for p in pairs):
        raise ConfigError(f"--static '{text}' must list PREFILL+DECODE worker pairs with --mode disagg, e.g. 1+2,2+4")
    return [(p[0], p[1]) for p in pairs]


def _floats(text: str, flag: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"{flag} '{text}' must be comma-separated numbers") from None
    if not values or not all(0 < v <= 1 for v in values):
        raise ConfigError(f"{flag} '{text}' must list fractions in (0, 1]")
    return values


async def _profile(args: EngineArgs, engine_name: str, speedup: float, sweep: Sweep) -> Profile:
    engine = load_engine(engine_name)(args)
    info = await engine.start()
    try:
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            console=Console(stderr=True),
            transient=False,
        ) as bar:
            task = bar.add_task("profiling", total=None)

            def step(what: str, done: int, total: int) -> None:
                bar.update(task, description=what, completed=done, total=total)

            return await profile_engine(
                engine,
                info,
                engine_name=engine_name,
                model=args.model,
                speedup_ratio=speedup,
                sweep=sweep,
                progress=step,
            )
    finally:
        await engine.stop()


@app.command("profile")
def profile_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="Profile JSON to write.")],
    engine: o.Engine = "mocker",
    model: o.Model = DEFAULT_MODEL,
    speedup_ratio: Annotated[
        float | None,
        typer.Option(
            "--speedup-ratio",
            help="mocker: run this much faster; times are multiplied back (default 10 for the mocker, else 1).",
        ),
    ] = None,
    num_gpu_blocks: o.NumGpuBlocks = None,
    max_num_seqs: o.MaxNumSeqs = None,
    context_length: o.ContextLength = None,
    engine_arg: o.EngineArg = None,
    isls: Annotated[str, typer.Option("--isls", help="Prefill sweep: prompt lengths.")] = "128,512,1024,2048,4096,8192",
    contexts: Annotated[str, typer.Option("--contexts", help="Decode sweep: context lengths.")] = "512,2048,8192",
    usages: Annotated[str, typer.Option("--usages", help="Decode sweep: KV usage fractions.")] = "0.05,0.25,0.5,0.9",
    plot: Annotated[Path | None, typer.Option("--plot", help="Also draw the profile (PNG; needs matplotlib).")] = None,
) -> None:
    """Sweep one engine in this process (prefill TTFT vs ISL, decode ITL vs KV usage and context) into a profile."""
    speedup = speedup_ratio if speedup_ratio is not None else (10.0 if engine == "mocker" else 1.0)
    sweep = Sweep(
        isls=_ints(isls, "--isls"), contexts=_ints(contexts, "--contexts"), usages=_floats(usages, "--usages")
    )
    extra = o.engine_extra(
        engine_arg,
        None,
        num_gpu_blocks=num_gpu_blocks,
        max_num_seqs=max_num_seqs,
        speedup_ratio=speedup if engine == "mocker" else None,
    )
    args = EngineArgs(model=model, context_length=context_length, extra=extra)
    profile = asyncio.run(_profile(args, engine, speedup, sweep))
    save_profile(profile, out)
    if plot is not None:
        from dynamo_cli.planner.plot import plot_profile

        plot_profile(profile, plot)
    print(f"profile written: {out} ({len(profile.prefill)} prefill, {len(profile.decode)} decode samples)")


def _report(step: Step) -> None:
    print(step, flush=True)


_opt = o.planner_option
SystemPort = Annotated[
    int | None,
    typer.Option(
        *SYSTEM_PORT.flags,
        envvar=SYSTEM_PORT.env,
        help="Port of the planner's /live, /health and /metrics (0: any free port; unset: none); /health is"
        " ready while it reads its frontends.",
    ),
]


PLANNER_KNOBS = settings.knobs(PlannerConfig)
"""The planner's own settings (targets, bounds, periods, forecast): `dyn serve --planner-*` takes them too."""


def _run_option(name: str, flag: str, kind: Any, default: Any, help: str) -> inspect.Parameter:
    """One of `dyn plan run`'s options that is not the planner's: where it reads, what it scales, how."""
    return settings.option(name, Annotated[kind, _opt(flag, help=help)], default)


RUN_OPTIONS = [
    _run_option("profile", "--profile", Path, ..., "Profile JSON from `dyn plan profile`."),
    _run_option(
        "frontend",
        "--frontend",
        list[str] | None,
        None,
        "Frontend URL to watch (repeatable; default: those in discovery).",
    ),
    _run_option(
        "connector",
        "--connector",
        str,
        "local",
        "local (dyn worker processes) | virtual | kubernetes (Deployment replicas).",
    ),
    _run_option("dry_run", "--dry-run", bool, False, "Only print decisions."),
    _run_option("duration", "--duration", float, 0.0, "Stop after this long (s; 0: never)."),
    _run_option("ack_timeout", "--ack-timeout", float, 1800.0, "virtual: wait for the ack (s)."),
    _run_option("k8s_namespace", "--k8s-namespace", str | None, None, "kubernetes: the Deployments' namespace."),
    _run_option(
        "k8s_decode_deployment",
        "--k8s-decode-deployment",
        str,
        "dyn-decode",
        "kubernetes: the decode (agg: the one) pool's Deployment.",
    ),
    _run_option(
        "k8s_prefill_deployment",
        "--k8s-prefill-deployment",
        str,
        "dyn-prefill",
        "kubernetes, disagg: the prefill pool's Deployment.",
    ),
    _run_option(
        "kubeconfig",
        "--kubeconfig",
        str | None,
        None,
        "kubernetes: kubeconfig file (default: in-cluster, else KUBECONFIG).",
    ),
    _run_option(
        "k8s_patch_interval",
        "--k8s-patch-interval",
        float,
        5.0,
        "kubernetes: least time between PATCHes of a Deployment (s).",
    ),
    _run_option(
        "k8s_ready_timeout", "--k8s-ready-timeout", float, 600.0, "kubernetes: wait for a scale-up's readyReplicas (s)."
    ),
    settings.option("engine", o.Engine, "mocker"),
    settings.option("model", o.Model, DEFAULT_MODEL),
    settings.option("speedup_ratio", o.SpeedupRatio, None),
    settings.option("engine_arg", o.EngineArg, None),
    _run_option("graceful_shutdown", "--graceful-shutdown", float, 5.0, "local: drain time (s)."),
    settings.option("namespace", o.Namespace, DEFAULT_NAMESPACE),
    settings.option("discovery", o.Discovery, "embedded"),
    settings.option("events", o.Events, "embedded"),
    settings.option("lease_ttl", o.LeaseTtl, 10.0),
    settings.option("cluster_secret_file", o.ClusterSecretFile, None),
    settings.option("system_port", SystemPort, None),
    _run_option(
        "host",
        "--host",
        str,
        "127.0.0.1",
        "Address of the system server (--system-port); 0.0.0.0 for a kubelet's probes.",
    ),
]


def _run(**values: Any) -> None:
    """Scale a deployment: each interval read the frontends' metrics, forecast, size the pools, apply."""
    config = settings.build(PlannerConfig, values, PLANNER_KNOBS)
    engine, mode, namespace = values["engine"], config.mode, values["namespace"]
    discovery, events, lease_ttl = values["discovery"], values["events"], values["lease_ttl"]
    secret = o.cluster_secret(values["cluster_secret_file"])
    worker = WorkerConfig(
        engine=engine,
        model=values["model"],
        namespace=namespace,
        role=Role.BOTH if mode == "agg" else Role.DECODE,
        component="backend",
        graceful_shutdown_s=values["graceful_shutdown"],
        planes=PlanesConfig(discovery=discovery, events=events, lease_ttl=lease_ttl, cluster_secret=secret),
        extra=o.engine_extra(values["engine_arg"], None, speedup_ratio=values["speedup_ratio"]),
    )
    prefill = replace(worker, role=Role.PREFILL, component=Role.PREFILL.value)
    env = {PARENT_ENV: str(os.getpid())}  # the rest travels in each worker's config document
    plan = PlanRun(
        planner=config,
        frontends=tuple(values["frontend"] or ()),
        namespace=namespace,
        discovery=discovery,
        events=events,
        lease_ttl=lease_ttl,
        connector=values["connector"],
        dry_run=values["dry_run"],
        decode=child_command(worker),
        prefill=child_command(prefill),
        worker_env=env,
        grace_s=values["graceful_shutdown"],
        ack_timeout_s=values["ack_timeout"],
        duration_s=values["duration"],
        host=values["host"],
        system_port=values["system_port"],
        kubernetes=_kubernetes(values, config),
    )
    run_loop(serve_planner(plan, load_profile(values["profile"]), _report, announce))
    sys.stdout.flush()


def _kubernetes(values: dict[str, Any], config: PlannerConfig) -> KubernetesConfig | None:
    """The Kubernetes connector's config (`--k8s-namespace` given), else None."""
    if values["k8s_namespace"] is None:
        return None
    return KubernetesConfig(
        namespace=values["k8s_namespace"],
        decode_deployment=values["k8s_decode_deployment"],
        prefill_deployment=values["k8s_prefill_deployment"] if config.mode == "disagg" else None,
        kubeconfig=values["kubeconfig"],
        min_replicas=config.bounds.min_workers,
        max_replicas=config.bounds.max_workers,
        min_patch_interval_s=values["k8s_patch_interval"],
        ready_timeout_s=values["k8s_ready_timeout"],
    )


run_command = app.command("run")(settings.command(_run, PLANNER_KNOBS, RUN_OPTIONS))


@app.command("simulate")
def simulate_command(
    profile: Annotated[Path, typer.Option("--profile", help="Profile JSON from `dyn plan profile`.")],
    ttft: Annotated[float, typer.Option("--ttft", help="TTFT target (ms).")],
    itl: Annotated[float, typer.Option("--itl", help="ITL target (ms).")],
    trace: Annotated[Path | None, typer.Option("--trace", help="Mooncake JSONL trace.")] = None,
    rate_curve: Annotated[
        str | None, typer.Option("--rate-curve", help="Synthetic Poisson load T:RATE,...,T_END:0 (s, req/s).")
    ] = None,
    linear: Annotated[
        bool, typer.Option("--linear", help="--rate-curve: the rate moves in a line from each point to the next.")
    ] = False,
    isl: Annotated[int, typer.Option("--isl", help="--rate-curve: prompt tokens.")] = 2000,
    osl: Annotated[int, typer.Option("--osl", help="--rate-curve: output tokens.")] = 150,
    static: Annotated[
        str, typer.Option("--static", help="Static pool sizes to compare (disagg: PREFILL+DECODE, e.g. 1+2,2+4).")
    ] = "1,4",
    mode: Annotated[str, typer.Option("--mode", help="agg (one pool) | disagg (prefill + decode pools).")] = "agg",
    interval: Annotated[float, typer.Option("--interval", help="Planner throughput step (s).")] = INTERVAL_S,
    load_interval: Annotated[float, typer.Option("--load-interval", help="Burst check (s; 0: off).")] = LOAD_INTERVAL_S,
    min_workers: Annotated[int, typer.Option("--min-workers", help="Fewest workers per pool.")] = 1,
    max_workers: Annotated[int, typer.Option("--max-workers", help="Most workers per pool.")] = 128,
    predictor: Annotated[str, typer.Option("--predictor", help=" | ".join(PREDICTORS))] = "constant",
    startup: Annotated[
        float, typer.Option("--startup", help="Seconds a new worker takes to serve (the planner is told).")
    ] = STARTUP_S,
    headroom: Annotated[float, typer.Option("--headroom", help="Size for this fraction of each target.")] = 0.8,
) -> None:
    """Replay a trace through simulated mocker workers in virtual time: static pools vs the planner and an oracle
    (the planner's sizing, knowing the future load: each worker starts a startup before the rate needs it)."""
    from dynamo_cli.planner.simulate import curve_rates, load_trace, run_simulation
    from dynamo_cli.planner.simulate import rate_curve as make_curve

    if (trace is None) == (rate_curve is None):
        raise ConfigError("give exactly one of --trace FILE and --rate-curve T:RATE,...")
    requests = load_trace(trace) if trace is not None else make_curve(rate_curve or "", isl, osl, linear=linear)
    config = PlannerConfig(
        targets=Targets(ttft, itl),
        bounds=Bounds(min_workers, max_workers),
        mode=mode,
        interval_s=interval,
        load_interval_s=load_interval,
        predictor=predictor,
        headroom=headroom,
        startup_s=startup,
    )
    check_run(PlanRun(planner=config, frontends=("simulated",), namespace="sim", discovery="embedded"))
    rates = curve_rates(rate_curve, isl, osl, linear) if rate_curve is not None else None
    results = run_simulation(requests, load_profile(profile), ttft, itl, _statics(static, mode), config, startup, rates)
    print(f"{len(requests)} requests; targets TTFT {ttft:g} ms, ITL {itl:g} ms")
    planned = next(r for r in results if r.policy == "planner")
    for result in results:
        gap = ""
        if result.policy == "oracle":  # the planner's sizing, knowing the load: what forecasting leaves
            gap = (
                f" (knows the load: each worker starts {startup:g} s before it is needed; the planner "
                f"{(planned.attainment - result.attainment) * 100:+.1f} points, "
                f"{planned.worker_seconds / max(result.worker_seconds, 1e-9) - 1:+.1%} worker-seconds)"
            )
        print(
            f"{result.policy:>12}: SLO attainment {result.attainment:6.1%}, worker-seconds "
            f"{result.worker_seconds:10.0f}, most workers {result.max_workers}{gap}"
        )
