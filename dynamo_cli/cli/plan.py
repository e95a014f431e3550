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
from dynamo_cli.cli import serve, settings
from dynamo_cli.config import DEFAULT_MODEL, PlanesConfig, WorkerConfig, child_command
from dynamo_cli.config.telemetry import SYSTEM_PORT
from dynamo_cli.engine import EngineArgs, Role, load_engine
from dynamo_cli.errors import ConfigError
from dynamo_cli.k8s.names import DEFAULT_K8S_NAMESPACE, Names, Part, check_name
from dynamo_cli.planner.kubernetes import KubernetesConfig
from dynamo_cli.planner.planner import PlannerConfig, Step
from dynamo_cli.planner.profile import Profile, load_profile, save_profile
from dynamo_cli.planner.profiler import Sweep, profile_engine
from dynamo_cli.planner.service import PlanRun, check_run, serve_planner
from dynamo_cli.runtime.supervisor import PARENT_ENV, announce
from dynamo_cli.runtime.supervisor import run as run_loop
from dynamo_cli.tracing.logs import use_log_format

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

WORKER_KNOBS = settings.knobs(WorkerConfig, skip={*serve.SKIP, "TelemetryConfig.system_port"}, help=o.HELP)
"""The local connector's workers, set as `dyn serve` sets its own (their address, name and role are the planner's
to place; `--system-port` is the planner's own)."""


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
    _run_option(
        "k8s_namespace",
        "--k8s-namespace",
        str,
        DEFAULT_K8S_NAMESPACE,
        "kubernetes: the Deployments' namespace (`dyn k8s render --namespace`).",
    ),
    _run_option(
        "k8s_decode_deployment",
        "--k8s-decode-deployment",
        str | None,
        None,
        "kubernetes: the decode pool's Deployment (default: as `dyn k8s render` names it: dyn-worker with --mode "
        "agg, dyn-decode with disagg).",
    ),
    _run_option(
        "k8s_prefill_deployment",
        "--k8s-prefill-deployment",
        str | None,
        None,
        "kubernetes, disagg: the prefill pool's Deployment (default: dyn-prefill, as `dyn k8s render` names it).",
    ),
    _run_option(
        "k8s_kind",
        "--k8s-kind",
        str,
        "Deployment",
        "kubernetes: the pools' kind: Deployment, or LeaderWorkerSet (`dyn k8s render --nodes-per-worker N`: "
        "its replicas are groups of N pods, one worker each).",
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
        "k8s_ready_timeout",
        "--k8s-ready-timeout",
        float,
        600.0,
        "kubernetes: warn when a scale-up's pods are not ready this long after it (s; nothing waits for them).",
    ),
    *o.ENGINE_OPTIONS,
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
    plan = plan_run(values)
    use_log_format(values["log_format"])  # the planner's own lines as its workers' (theirs travel in their config)
    run_loop(serve_planner(plan, load_profile(values["profile"]), _report, announce))
    sys.stdout.flush()


def plan_run(values: dict[str, Any]) -> PlanRun:
    """What `dyn plan run`'s options (`values`) describe: the planner, and its local connector's workers built
    from their own settings as `dyn worker` builds them (the role and component the pool's)."""
    config = settings.build(PlannerConfig, values, PLANNER_KNOBS)
    given = {
        (WorkerConfig, "extra"): o.engine_options(values),
        (WorkerConfig, "role"): Role.BOTH if config.mode == "agg" else Role.DECODE,
        (WorkerConfig, "component"): "backend",
        (PlanesConfig, "cluster_secret"): o.cluster_secret(values["cluster_secret_file"]),
    }
    worker = settings.build(WorkerConfig, values, WORKER_KNOBS, given)
    namespace, planes = worker.namespace, worker.planes
    prefill = replace(worker, role=Role.PREFILL, component=Role.PREFILL.value)
    env = {PARENT_ENV: str(os.getpid())}  # the rest travels in each worker's config document
    return PlanRun(
        planner=config,
        frontends=tuple(values["frontend"] or ()),
        namespace=namespace,
        discovery=planes.discovery,
        events=planes.events,
        lease_ttl=planes.lease_ttl,
        connector=values["connector"],
        dry_run=values["dry_run"],
        decode=child_command(worker),
        prefill=child_command(prefill),
        worker_env=env,
        grace_s=worker.graceful_shutdown_s,
        ack_timeout_s=values["ack_timeout"],
        duration_s=values["duration"],
        host=values["host"],
        system_port=values["system_port"],
        kubernetes=_kubernetes(values, config),
    )


def _kubernetes(values: dict[str, Any], config: PlannerConfig) -> KubernetesConfig | None:
    """The Kubernetes connector's config (`--connector kubernetes`), else None."""
    if values["connector"] != "kubernetes":
        return None
    names, is_disagg = Names(), config.mode == "disagg"
    decode = values["k8s_decode_deployment"] or names.of(Part.DECODE if is_disagg else Part.WORKER)
    return KubernetesConfig(
        namespace=check_name("--k8s-namespace", values["k8s_namespace"]),
        decode_deployment=decode,
        prefill_deployment=(values["k8s_prefill_deployment"] or names.of(Part.PREFILL)) if is_disagg else None,
        kind=values["k8s_kind"],
        kubeconfig=values["kubeconfig"],
        min_replicas=config.bounds.min_workers,
        max_replicas=config.bounds.max_workers,
        min_patch_interval_s=values["k8s_patch_interval"],
        ready_timeout_s=values["k8s_ready_timeout"],
    )


run_command = app.command("run")(settings.command(_run, [*PLANNER_KNOBS, *WORKER_KNOBS], RUN_OPTIONS))


def _simulate_option(name: str, flag: str, kind: Any, default: Any, help: str) -> inspect.Parameter:
    return settings.option(name, Annotated[kind, typer.Option(flag, help=help)], default)


SIMULATE_OPTIONS = [
    _simulate_option("profile", "--profile", Path, ..., "Profile JSON from `dyn plan profile`."),
    _simulate_option("trace", "--trace", Path | None, None, "Mooncake JSONL trace."),
    _simulate_option(
        "rate_curve", "--rate-curve", str | None, None, "Synthetic Poisson load T:RATE,...,T_END:0 (s, req/s)."
    ),
    _simulate_option(
        "linear", "--linear", bool, False, "--rate-curve: the rate moves in a line from each point to the next."
    ),
    _simulate_option("isl", "--isl", int, 2000, "--rate-curve: prompt tokens."),
    _simulate_option("osl", "--osl", int, 150, "--rate-curve: output tokens."),
    _simulate_option(
        "static", "--static", str, "1,4", "Static pool sizes to compare (disagg: PREFILL+DECODE, e.g. 1+2,2+4)."
    ),
]


def _simulate(**values: Any) -> None:
    """Replay a trace through simulated mocker workers in virtual time: static pools vs the planner (as `dyn plan
    run` would run with the same flags) and an oracle (the planner's sizing, knowing the future load: each worker
    starts a startup before the rate needs it)."""
    from dynamo_cli.planner.simulate import curve_rates, load_trace, run_simulation
    from dynamo_cli.planner.simulate import rate_curve as make_curve

    config = settings.build(PlannerConfig, values, PLANNER_KNOBS)
    trace, rate_curve, isl, osl, linear = (values[k] for k in ("trace", "rate_curve", "isl", "osl", "linear"))
    if (trace is None) == (rate_curve is None):
        raise ConfigError("give exactly one of --trace FILE and --rate-curve T:RATE,...")
    requests = load_trace(trace) if trace is not None else make_curve(rate_curve or "", isl, osl, linear=linear)
    ttft, itl, startup = config.targets.ttft_ms, config.targets.itl_ms, config.startup_s
    check_run(PlanRun(planner=config, frontends=("simulated",), namespace="sim", discovery="embedded"))
    rates = curve_rates(rate_curve, isl, osl, linear) if rate_curve is not None else None
    statics = _statics(values["static"], config.mode)
    results = run_simulation(requests, load_profile(values["profile"]), ttft, itl, statics, config, startup, rates)
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
        ranks = f" × {result.ranks_per_worker} ranks" if result.ranks_per_worker > 1 else ""
        print(
            f"{result.policy:>12}: SLO attainment {result.attainment:6.1%}, worker-seconds "
            f"{result.worker_seconds:10.0f}, most workers {result.max_workers}{ranks}{gap}"
        )


simulate_command = app.command("simulate")(settings.command(_simulate, PLANNER_KNOBS, SIMULATE_OPTIONS))
