"""`dyn k8s`: a `dyn serve` deployment as Kubernetes manifests (`render`), and how it is doing (`status`).

`dyn k8s render` takes `dyn serve`'s flags and writes what each pod runs as the same `dyn` command line a
multi-node script would hold (`dyn serve --workers 0` for the frontend, `dyn worker`, `dyn router`, `dyn plan
run --connector kubernetes`), so a pod runs exactly the config the flags describe (tests/k8s parse each one
back). Secrets stay out of the YAML: it prints the `kubectl create secret` lines that make them.
"""

from __future__ import annotations

import difflib
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from dynamo_cli.cli import plan, serve, settings
from dynamo_cli.cli import router as router_cmd
from dynamo_cli.cli import worker as worker_cmd
from dynamo_cli.cli.k8s_groups import GROUPS, group_flags, with_groups
from dynamo_cli.cli.k8s_keda import KEDA, keda_scaling
from dynamo_cli.cli.k8s_status import status_command
from dynamo_cli.cli.k8s_target import K8S, KNOBS, TENSOR_PARALLEL, ClusterTarget, opt, target_of
from dynamo_cli.config import WorkerConfig
from dynamo_cli.engine import Role
from dynamo_cli.errors import ConfigError
from dynamo_cli.k8s.names import (
    API_KEYS_DIR,
    API_KEYS_KEY,
    LEADER_WORKER_SET,
    PLANES_DIR,
    PORTS,
    PROFILE_DIR,
    TLS_DIR,
    Part,
)
from dynamo_cli.k8s.objects import Component, Group, Mount, Obj, Probe, Resources
from dynamo_cli.k8s.render import kubectl_lines, render
from dynamo_cli.kv.tiers import KvTierConfig
from dynamo_cli.planner.profile import load_profile

app = typer.Typer(help="Kubernetes: render a deployment's manifests, report its status.", no_args_is_help=True)


WORKER_ONLY = (WorkerConfig, KvTierConfig)
FRONTEND_KNOBS = [k for k in serve.KNOBS if not all(cls in WORKER_ONLY for cls, _ in k.fields)]
"""`dyn serve --workers 0`'s options that act on the frontend (the pod runs no worker)."""


@app.callback()
def _group() -> None:
    """Kubernetes: render a deployment's manifests, report its status."""


def _load_values(ctx: typer.Context, path: Path | None) -> Path | None:
    """`--values FILE`: a YAML mapping of option names (`prefill-workers: 2`) read as the defaults the other
    flags override (a render reproducible from a checked-in file)."""
    if path is None:
        return None
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise typer.BadParameter(f"cannot be read as YAML: {exc}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise typer.BadParameter("must hold a YAML mapping of option names to values (e.g. `workers: 2`)")
    known = {  # a flag's long name (`prefill-workers`, `no-kv-events`) -> its parameter
        opt.lstrip("-"): param
        for param in ctx.command.params
        if param.name not in (None, "values")
        for opt in (*param.opts, *param.secondary_opts)
        if opt.startswith("--")
    }
    defaults: dict[str, Any] = {}
    for key, value in loaded.items():
        flag = str(key).lstrip("-").replace("_", "-")
        if flag not in known:
            close = difflib.get_close_matches(flag, known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise typer.BadParameter(f"'{key}' is not an option of dyn k8s render{hint}")
        param = known[flag]
        is_negation = f"--{flag}" in param.secondary_opts
        defaults[str(param.name)] = (not value) if is_negation else value
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return path


EXTRA = [
    settings.option(
        "values",
        Annotated[
            Path | None,
            typer.Option(
                "--values",
                help="YAML file of option values (`workers: 2`, `disagg: true`); flags given override it.",
                is_eager=True,
                callback=_load_values,
                rich_help_panel="Kubernetes",
            ),
        ],
        None,
    ),
    *K8S,
    *KEDA,
    *GROUPS,
    opt("out", "--out", Path | None, None, "Write one YAML file per component (and secrets.sh) here, not stdout."),
    *serve.EXTRA,
]
"""`--values`, render's own options (KEDA's and the groups' among them), `--out`, then `dyn serve`'s (its shape,
engine, API keys, planner)."""


def _render(**values: Any) -> None:
    """Write the Kubernetes manifests of a `dyn serve` deployment (same flags) as YAML: stdout or --out DIR."""
    out = values.pop("out")
    target = _target(values)
    components, config_maps = _components(target)
    objects = render(target.cluster, components, config_maps)
    lines = kubectl_lines(target.cluster, target.secrets) + _yours(target)
    if out is None:
        sys.stdout.write(yaml.safe_dump_all(objects, sort_keys=False))
    else:
        _write(Path(out), objects, lines)
    typer.echo("# create the namespace and the Secrets the manifests reference, then apply:", err=True)
    for line in lines:
        typer.echo(line, err=True)
    typer.echo(f"kubectl apply -k {out}" if out is not None else "kubectl apply -f -", err=True)


def _target(values: dict[str, Any]) -> ClusterTarget:
    """What the flags describe, with KEDA's scaling (checked first: it reads `--planner`, which target_of takes) and
    the worker groups' scheduling."""
    keda = keda_scaling(values)
    groups = {p.name: values.pop(p.name) for p in GROUPS}
    target = with_groups(target_of(values), groups)
    return replace(target, cluster=replace(target.cluster, keda=keda))


def _yours(target: ClusterTarget) -> list[str]:
    """Comment lines naming the Secrets the manifests reference that are yours to create (`--hf-token-secret`,
    `--env-from`)."""
    ns = target.cluster.namespace
    lines = [
        f"# yours: Secret {e.secret} with key {e.key} ({e.name}), e.g. kubectl -n {ns} create secret generic "
        f"{e.secret} --from-file={e.key}=FILE"
        for e in target.model.secret_env
    ]
    return lines + [f"# yours: Secret {name} (each key a variable of every dyn container)" for name in target.env_from]


def _components(target: ClusterTarget) -> tuple[list[Component], dict[str, dict[str, str]]]:
    config, names = target.config, target.cluster.names
    components = [_frontend(target)]
    pools = [(Part.DECODE, Role.DECODE, config.num_workers), (Part.PREFILL, Role.PREFILL, config.num_prefill_workers)]
    if not config.num_prefill_workers:
        pools = [(Part.WORKER, Role.BOTH, config.num_workers)]
    components += [_worker(target, part, role, n) for part, role, n in pools]
    if config.frontend.router == "remote":
        components.append(_router(target))
    config_maps: dict[str, dict[str, str]] = {}
    if target.plan is not None:
        assert target.plan.profile is not None  # serve.deployment(in_process=False) demands one
        text = target.plan.profile.read_text()
        load_profile(target.plan.profile)  # a bad profile fails here, not in the pod
        config_maps[names.planner_profile] = {"profile.json": text}
        components.append(_planner(target, [p for p, _, _ in pools]))
    if any(secret.name == names.planes for secret in target.secrets):  # every process talks to etcd and NATS
        planes = Mount("planes", PLANES_DIR, secret=names.planes)
        components = [replace(c, mounts=(*c.mounts, planes)) for c in components]
    return components, config_maps


def _frontend(target: ClusterTarget) -> Component:
    config, batches = target.config, target.batches
    frontend = replace(config.frontend, host="0.0.0.0", batch=replace(config.frontend.batch, db=batches.db))
    pod = replace(config, frontend=frontend, num_workers=0, num_prefill_workers=0, num_routers=0, nodes_per_worker=1)
    args = ["serve", *settings.arguments(pod, FRONTEND_KNOBS)]
    if "--workers" not in args:
        args += ["--workers", "0"]
    mounts = [*batches.mounts, *target.model.mounts]
    if frontend.auth.api_keys:
        args += ["--api-key-file", f"{API_KEYS_DIR}/{API_KEYS_KEY}"]
        mounts.append(Mount("api-keys", API_KEYS_DIR, secret=target.cluster.names.api_keys))
    if frontend.tls.is_enabled:
        args = _mounted(args, {"--tls-cert-file": "tls.crt", "--tls-key-file": "tls.key", "--tls-ca-file": "ca.crt"})
        mounts.append(Mount("tls", TLS_DIR, secret=target.cluster.names.tls))
    scheme = "HTTPS" if frontend.tls.is_enabled else "HTTP"
    return Component(
        part=Part.FRONTEND,
        args=tuple(args),
        replicas=target.frontend_replicas,
        # `--frontends N`: N processes in the pod, on its port, with one router view and one /metrics
        resources=Resources(str(config.num_frontends), f"{2 * config.num_frontends}Gi"),
        ports=(("http", frontend.port),)
        + ((("grpc", frontend.kserve_grpc_port),) if frontend.kserve_grpc_port else ()),
        # /live, not /health: a frontend with no worker yet still answers (503s naming why), and the planner
        # must reach its /metrics to scale up from zero.
        probe=Probe("http", live="/live", ready="/live", scheme=scheme, tcp=frontend.tls.ca_file is not None),
        scrape_port=frontend.port,
        advertise_env="DYN_HTTP_ADVERTISE_HOST",  # the planner reads each pod's /metrics at the URL it registers
        mounts=tuple(mounts),
        grace_s=frontend.graceful_shutdown_s,  # the HTTP server's own drain (uvicorn's graceful timeout)
        env=(*target.model.env, *target.env),
        secret_env=(*batches.secret_env, *target.model.secret_env),
        env_from=target.env_from,
        placement=target.pod_placement,
    )


def _mounted(args: list[str], files: dict[str, str]) -> list[str]:
    """`args` with each named flag's file replaced by the mounted Secret key's path."""
    out = list(args)
    for i, arg in enumerate(args[:-1]):
        if arg in files:
            out[i + 1] = f"{TLS_DIR}/{files[arg]}"
    return out


def _worker(target: ClusterTarget, part: Part, role: Role, replicas: int) -> Component:
    pool = target.pools[role]
    config, mounts = _worker_config(target, role)
    group, leader_flags = _node_group(target, config)
    args = _worker_args(config) + leader_flags
    mounts += target.model.mounts
    if pool.resources.gpus:
        mounts.append(Mount("shm", "/dev/shm", size=target.shm_size, memory=True))
    ports = [("request", PORTS.request_plane), ("system", PORTS.system)]
    if role is Role.PREFILL:
        ports.append(("kv-transfer", PORTS.kv_transfer))
    return Component(
        part=part,
        args=tuple(args),
        # the planner's or KEDA's count: a re-apply must not reset it
        replicas=None if target.plan is not None or target.cluster.keda is not None else replicas,
        resources=pool.resources,
        ports=tuple(ports),
        probe=Probe("system"),
        scrape_port=PORTS.system,
        advertise_env="DYN_WORKER_HOST",
        mounts=tuple(mounts),
        grace_s=config.graceful_shutdown_s,
        startup_s=target.startup_s,
        env=(*target.model.env, *target.env),
        secret_env=target.model.secret_env,
        env_from=target.env_from,
        placement=target.placement,
        group=group,
    )


def _worker_args(config: WorkerConfig) -> list[str]:
    args = ["worker", *settings.arguments(config, worker_cmd.KNOBS)]
    if "--engine" not in args:  # always named: the image's own DYN_ENGINE must not choose
        args[1:1] = ["--engine", config.engine]
    if config.extra:
        args += ["--extra-engine-args", json.dumps(config.extra, sort_keys=True)]
    return args


def _node_group(target: ClusterTarget, config: WorkerConfig) -> tuple[Group | None, list[str]]:
    """`--nodes-per-worker N` > 1: the pool's groups, what their followers run (no system port: the leader's
    probes and metrics are the group's), and the leader's group flags; else (None, [])."""
    nodes = target.config.nodes_per_worker
    if nodes == 1:
        return None, []
    leader, follower = group_flags(config, nodes, target.startup_s)
    quiet = replace(config, telemetry=replace(config.telemetry, system_port=None))
    return Group(nodes, tuple(_worker_args(quiet) + follower)), leader


def _worker_config(target: ClusterTarget, role: Role) -> tuple[WorkerConfig, list[Mount]]:
    """The pool's `dyn worker` config (its pod's address, ports and role, its engine over every GPU of the pod, or
    of the group's pods) and the disk tier's emptyDir."""
    base, pool = target.config.worker, target.pools[role]
    extra = {**base.extra, **pool.engine_args}
    parallel, gpus = TENSOR_PARALLEL.get(base.engine), pool.resources.gpus * target.config.nodes_per_worker
    if parallel is not None and gpus > 1:  # one engine over the pod's (group's) GPUs, not one of them
        extra.setdefault(parallel, gpus)
    tiers, mounts = base.kv_tiers, []
    if tiers.disk_bytes:  # the disk tier on an emptyDir of its size
        disk_dir = tiers.disk_dir or "/var/cache/dyn-kv"
        tiers = replace(tiers, disk_dir=disk_dir)
        mounts.append(Mount("kv-disk", disk_dir, size=f"{-(-tiers.disk_bytes // 10**9)}G"))
    config = replace(
        base,
        extra=extra,
        role=role,
        component="backend" if role is not Role.PREFILL else Role.PREFILL.value,
        port=PORTS.request_plane,
        kv_transfer_port=PORTS.kv_transfer if role is Role.PREFILL else 0,
        telemetry=replace(base.telemetry, system_port=PORTS.system),
        kv_tiers=tiers,
    )
    return config, mounts


def _router(target: ClusterTarget) -> Component:
    config = target.config.router_config()
    config = replace(config, port=PORTS.request_plane, telemetry=replace(config.telemetry, system_port=PORTS.system))
    return Component(
        part=Part.ROUTER,
        args=("router", *settings.arguments(config, router_cmd.KNOBS)),
        replicas=max(1, target.config.num_routers),
        resources=Resources("1", "1Gi"),
        ports=(("request", PORTS.request_plane), ("system", PORTS.system)),
        probe=Probe("system"),
        scrape_port=PORTS.system,
        advertise_env="DYN_ROUTER_HOST",
        grace_s=config.graceful_shutdown_s,
        env=target.env,
        env_from=target.env_from,
        placement=target.pod_placement,
    )


def _planner(target: ClusterTarget, pools: list[Part]) -> Component:
    assert target.plan is not None
    planner, names, config = target.plan.config, target.cluster.names, target.config
    worker = config.worker
    args = ["plan", "run", "--connector", "kubernetes", "--k8s-namespace", target.cluster.namespace]
    args += ["--k8s-decode-deployment", names.of(pools[0])]
    if len(pools) > 1:
        args += ["--k8s-prefill-deployment", names.of(pools[1])]
    if config.nodes_per_worker > 1:  # it scales groups: the LeaderWorkerSets' replicas
        args += ["--k8s-kind", LEADER_WORKER_SET.kind]
    args += ["--profile", f"{PROFILE_DIR}/profile.json", *settings.arguments(planner, plan.PLANNER_KNOBS)]
    # no --frontend: it reads every frontend pod's /metrics at the address the pod registered in discovery (through
    # the Service, each scrape would land on a random pod and the counters' rates would be wrong)
    args += ["--engine", worker.engine, "--model", worker.model, "--namespace", worker.namespace]
    args += ["--discovery", worker.planes.discovery, "--events", worker.planes.events]
    args += ["--system-port", str(PORTS.system), "--host", "0.0.0.0"]  # the kubelet probes the pod's address
    return Component(
        part=Part.PLANNER,
        args=tuple(args),
        replicas=1,
        resources=Resources("250m", "512Mi"),
        ports=(("system", PORTS.system),),
        probe=Probe("system"),
        scrape_port=PORTS.system,
        cluster_secret=False,
        mounts=(Mount("profile", PROFILE_DIR, config_map=names.planner_profile),),
        service_account=names.of(Part.PLANNER),
        single_writer=True,
        env=target.env,
        env_from=target.env_from,
        placement=target.pod_placement,
    )


def _write(out: Path, objects: list[Obj], lines: list[str]) -> None:
    """One file per component (and `deployment.yaml` for the whole deployment's objects), a kustomization.yaml
    listing them (an overlay of yours names this directory as its base, so its patches survive a re-render), and
    secrets.sh."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        groups: dict[str, list[Obj]] = {}
        for obj in objects:
            part = obj["metadata"]["labels"].get("app.kubernetes.io/component", "deployment")
            groups.setdefault(part, []).append(obj)
        for part, group in groups.items():
            (out / f"{part}.yaml").write_text(yaml.safe_dump_all(group, sort_keys=False))
        kustomization = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [f"{part}.yaml" for part in groups],
        }
        (out / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
        script = "#!/bin/sh\n# The namespace and the Secrets the manifests reference (no value is in them).\nset -e\n"
        (out / "secrets.sh").write_text(script + "\n".join(lines) + "\n")
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot write the manifests ({exc.strerror or exc})") from None


RENDER_KNOBS = [*KNOBS, *serve.PLANNER_KNOBS]
render_command = settings.command(_render, RENDER_KNOBS, EXTRA, env=False)  # flags and --values only: reproducible
app.command("render", help=_render.__doc__)(render_command)
app.command("status", help=status_command.__doc__)(status_command)
