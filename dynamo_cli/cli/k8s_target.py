"""What one `dyn k8s render` writes, from its flags: the deployment (`dyn serve`'s flags), where it runs, each worker
pool's resources, where the model comes from, the Secrets it needs; and the checks that refuse, with one line
naming the flag, what a cluster would not run as rendered (cli/k8s.py turns a ClusterTarget into pods)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from dynamo_cli import __version__
from dynamo_cli.cli import options as o
from dynamo_cli.cli import serve, settings
from dynamo_cli.cli.k8s_batches import BatchStorage, batch_storage
from dynamo_cli.cli.k8s_planes import plane_url
from dynamo_cli.config import AuthConfig, FrontendConfig, PlanesConfig, ServeConfig, WorkerConfig, read_api_keys
from dynamo_cli.engine import Role
from dynamo_cli.errors import ConfigError
from dynamo_cli.k8s import bundled
from dynamo_cli.k8s.names import (
    API_KEYS_KEY,
    CLUSTER_SECRET_KEY,
    DEFAULT_K8S_NAMESPACE,
    HF_TOKEN_KEY,
    MODEL_CACHE_DIR,
    MODELS_DIR,
    Names,
    check_name,
)
from dynamo_cli.k8s.objects import Mount, Placement, Resources, SecretEnv, Toleration
from dynamo_cli.k8s.render import Cluster, SecretSource
from dynamo_cli.launcher import ServePlan
from dynamo_cli.model.paths import MODEL_ALIASES

SKIP = serve.SKIP | {
    "FrontendConfig.host",  # every pod listens on its own address
    "FrontendConfig.namespace",  # the Kubernetes namespace (--namespace) is the dyn namespace too
    "WorkerConfig.namespace",
    "PlanesConfig.discovery",  # --etcd / --nats
    "PlanesConfig.events",
    "PlanesConfig.start_wait_s",  # the start-up allowance (--startup-timeout): etcd may bind its volume meanwhile
    "TelemetryConfig.system_port",  # every worker, router and planner serves probes on PORTS.system
    "ServeConfig.ready_timeout_s",  # Kubernetes waits (readiness) and restarts (restartPolicy)
    "ServeConfig.max_restarts",
    "WorkerConfig.graceful_shutdown_s",  # render's own --graceful-shutdown: a pod's drain, 60 s by default
    "GroupConfig.join_timeout_s",  # --startup-timeout: a group's pods may wait that long for their nodes
}
KNOBS = settings.knobs(ServeConfig, skip=SKIP, help=o.HELP)
POOL_SIZES = (
    ("--workers", "workers"),
    ("--decode-workers", "decode_workers"),
    ("--prefill-workers", "prefill_workers"),
)
"""`dyn serve`'s worker counts: flag, value name."""


def opt(name: str, flag: str, kind: Any, default: Any, help: str) -> Any:
    """One of render's own options (the Kubernetes panel of its --help)."""
    panel = "Kubernetes"
    return settings.option(name, Annotated[kind, typer.Option(flag, help=help, rich_help_panel=panel)], default)


K8S = [
    opt("k8s_namespace", "--namespace", str, DEFAULT_K8S_NAMESPACE, "Kubernetes namespace (also the dyn namespace)."),
    opt("name", "--name", str, "dyn", "Prefix of every object's name; two deployments may share a namespace."),
    opt("image", "--image", str | None, None, "The dyn image, tagged (default: dyn:VERSION-ENGINE, Containerfile)."),
    opt("gpus_per_worker", "--gpus-per-worker", int, 0, "nvidia.com/gpu each worker requests."),
    opt("worker_cpu", "--worker-cpu", str, "2", "CPU each worker requests."),
    opt("worker_memory", "--worker-memory", str, "8Gi", "Memory each worker requests (and is limited to)."),
    opt(
        "prefill_gpus_per_worker",
        "--prefill-gpus-per-worker",
        int | None,
        None,
        "--disagg: nvidia.com/gpu each prefill worker requests (default: --gpus-per-worker).",
    ),
    opt("prefill_worker_cpu", "--prefill-worker-cpu", str | None, None, "--disagg: (default: --worker-cpu)."),
    opt("prefill_worker_memory", "--prefill-worker-memory", str | None, None, "--disagg: (default: --worker-memory)."),
    opt(
        "prefill_engine_arg",
        "--prefill-engine-arg",
        list[str] | None,
        None,
        "--disagg: KEY=VALUE for the prefill workers' engine only (repeatable; over --engine-arg).",
    ),
    opt(
        "decode_engine_arg",
        "--decode-engine-arg",
        list[str] | None,
        None,
        "--disagg: KEY=VALUE for the decode workers' engine only (repeatable; over --engine-arg).",
    ),
    opt("model_pvc", "--model-pvc", str | None, None, "PersistentVolumeClaim of model files, mounted at /models."),
    opt(
        "model_cache_pvc",
        "--model-cache-pvc",
        str | None,
        None,
        f"ReadWriteMany PersistentVolumeClaim of yours at {MODEL_CACHE_DIR} (HF_HOME): workers download a hub "
        "--model into it once, and the frontend reads its tokenizer there.",
    ),
    opt(
        "hf_token_secret",
        "--hf-token-secret",
        str | None,
        None,
        f"Secret whose key '{HF_TOKEN_KEY}' is HF_TOKEN (gated hub models), for the workers and the frontend.",
    ),
    opt(
        "startup_timeout",
        "--startup-timeout",
        float,
        7200.0,
        "Seconds a worker may take to load its model before its liveness probe counts (its startupProbe).",
    ),
    opt(
        "graceful_shutdown",
        "--graceful-shutdown",
        float,
        60.0,
        "Seconds a pod's process drains the streams it admitted after SIGTERM (the pods' grace period follows).",
    ),
    opt("shm_size", "--shm-size", str, "8Gi", "GPU workers' /dev/shm (RAM, counted in --worker-memory)."),
    opt(
        "node_selector",
        "--node-selector",
        list[str] | None,
        None,
        "Workers: LABEL=VALUE a node must carry (repeatable).",
    ),
    opt(
        "toleration",
        "--toleration",
        list[str] | None,
        None,
        "Workers tolerate this taint: KEY[=VALUE][:EFFECT] (repeatable; e.g. nvidia.com/gpu:NoSchedule).",
    ),
    opt(
        "worker_resource",
        "--worker-resource",
        list[str] | None,
        None,
        "Workers request (and are limited to) NAME=QUANTITY more (repeatable; rdma/ib=1, amd.com/gpu=8).",
    ),
    opt("ipc_lock", "--ipc-lock", bool, False, "Workers get CAP_IPC_LOCK (RDMA pins memory; beyond restricted PSS)."),
    opt("priority_class", "--priority-class", str | None, None, "PriorityClass of every dyn pod."),
    opt("image_pull_secret", "--image-pull-secret", list[str] | None, None, "Every pod's pull Secret (repeatable)."),
    opt("env", "--env", list[str] | None, None, "NAME=VALUE in every dyn container (repeatable)."),
    opt("env_from", "--env-from", list[str] | None, None, "A Secret whose keys become variables (repeatable)."),
    opt("pod_monitor", "--pod-monitor", bool, False, "A prometheus-operator PodMonitor scraping every pod."),
    opt(
        "gateway",
        "--gateway",
        str | None,
        None,
        "[NAMESPACE/]NAME of a Gateway (Gateway API): an HTTPRoute from it to the frontend, with no request timeout.",
    ),
    opt("hostname", "--hostname", list[str] | None, None, "--gateway: a hostname the route answers (repeatable)."),
    opt(
        "planes_replicas",
        "--planes-replicas",
        int,
        1,
        "Members of the bundled etcd and NATS: 1, or a quorum of 3 or 5 (each with a disruption budget).",
    ),
    opt(
        "frontend_replicas",
        "--frontend-replicas",
        int,
        1,
        "Frontend pods (each with --frontends processes): >1 shares the routers' load (--router-replica-sync) and "
        "needs a --batch-db that is postgresql:// or off.",
    ),
    opt(
        "allow_public",
        "--allow-public",
        bool,
        False,
        "Let --service-type NodePort/LoadBalancer expose the API (and /metrics) with no --api-key-file.",
    ),
    opt("etcd", "--etcd", str, "bundled", "bundled (a StatefulSet) or an etcd:// URL."),
    opt("nats", "--nats", str, "bundled", "bundled (a StatefulSet) or a nats:// URL."),
    opt("storage_class", "--storage-class", str | None, None, "The bundled planes' volumes (default: the cluster's)."),
    opt("service_type", "--service-type", str, "ClusterIP", "The frontend Service: ClusterIP|NodePort|LoadBalancer."),
    opt("metrics_namespace", "--metrics-namespace", str | None, None, "Namespace of a Prometheus let in to scrape."),
    opt("batch_storage", "--batch-storage", str, "10Gi", "The frontend's batch database volume (SQLite --batch-db)."),
    opt(
        "batch_db_password_file",
        "--batch-db-password-file",
        Path | None,
        None,
        "File holding a postgresql:// --batch-db's password: a Secret, the frontend's PGPASSWORD.",
    ),
]
"""Render's own options: where and how the deployment runs on Kubernetes."""


SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
GPU_ENGINES = ("vllm", "sglang", "trtllm")
TENSOR_PARALLEL = {"vllm": "tensor_parallel_size", "sglang": "tp_size", "trtllm": "tensor_parallel_size"}
"""Each GPU engine's option for the GPUs one engine spans: set to the pod's GPU count unless given."""
PREFILL_ONLY = (
    "prefill_gpus_per_worker",
    "prefill_worker_cpu",
    "prefill_worker_memory",
    "prefill_engine_arg",
    "decode_engine_arg",
)
"""Render's flags of one pool of a disaggregated deployment."""
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True, slots=True)
class ClusterTarget:
    """What one render writes: the deployment, where, and the Secrets it needs first."""

    config: ServeConfig
    plan: ServePlan | None
    cluster: Cluster
    secrets: list[SecretSource]
    pools: dict[Role, PoolShape]
    """The worker pools' resources and engine options, by role (BOTH, or DECODE and PREFILL)."""
    model: ModelSource
    batches: BatchStorage
    startup_s: float
    """The workers' startupProbe allowance (`--startup-timeout`)."""
    shm_size: str
    env: tuple[tuple[str, str], ...]
    env_from: tuple[str, ...]
    frontend_replicas: int
    placement: Placement
    """The worker pods' (node selector, tolerations, RDMA) and, of it, what every pod gets (priority, pull
    Secrets): `pod_placement`."""

    @property
    def pod_placement(self) -> Placement:
        return Placement(
            priority_class=self.placement.priority_class, image_pull_secrets=self.placement.image_pull_secrets
        )


@dataclass(frozen=True, slots=True)
class PoolShape:
    """One worker pool's pods: what each requests, and the engine options only it gets."""

    resources: Resources
    engine_args: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where the pods find the model: its claim (`--model-pvc`), a download cache (`--model-cache-pvc`), and the
    token of a gated hub model; mounted in the workers and the frontend alike (the frontend reads the tokenizer
    at the path a worker reports)."""

    mounts: tuple[Mount, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    secret_env: tuple[SecretEnv, ...] = ()


def target_of(values: dict[str, Any]) -> ClusterTarget:
    """What `dyn k8s render`'s options (`values`) describe, checked: a render refuses what a cluster would not run."""
    values.pop("values")
    k8s = {p.name: values.pop(p.name) for p in K8S}
    ns, names = check_name("--namespace", k8s["k8s_namespace"]), Names(check_name("--name", k8s["name"]))
    _check_flags(values, k8s)
    image = k8s["image"] or f"dyn:{__version__}-{values['engine']}"
    _check_image(image)
    secrets, api_keys = _key_secrets(values, names)
    members = k8s["planes_replicas"]
    discovery, etcd_files = plane_url(k8s["etcd"], "--etcd", bundled.etcd_url(names, members))
    events, nats_files = plane_url(k8s["nats"], "--nats", bundled.nats_url(names, members))
    if etcd_files or nats_files:
        secrets.append(SecretSource(names.planes, etcd_files + nats_files))
    planes = {"discovery": discovery, "events": events, "cluster_secret": None}
    config, plan = serve.deployment(values, _given(k8s, ns, planes, api_keys), KNOBS, in_process=False)
    secrets += _frontend_secrets(config, plan, names)
    pools, model = _pools(config, k8s), _model_source(config.worker, k8s)
    _check_worker_fit(config.worker, pools, model)
    batches = batch_storage(config.frontend.batch.db, k8s["batch_storage"], k8s["batch_db_password_file"], names)
    if batches.secret is not None:
        secrets.append(batches.secret)
    env = tuple(_env_pair(item) for item in k8s["env"] or ())
    env_from = tuple(check_name("--env-from", name) for name in k8s["env_from"] or ())
    cluster = _cluster(config, k8s, ns, names, image)
    startup_s, shm = k8s["startup_timeout"], k8s["shm_size"]
    replicas, placement = k8s["frontend_replicas"], _placement(k8s)
    return ClusterTarget(
        config, plan, cluster, secrets, pools, model, batches, startup_s, shm, env, env_from, replicas, placement
    )


def _given(k8s: dict[str, Any], ns: str, planes: dict[str, Any], api_keys: tuple[str, ...]) -> dict[Any, Any]:
    """The settings a pod's command line gets from render rather than from `dyn serve`'s flags."""
    given: dict[Any, Any] = {(PlanesConfig, name): value for name, value in planes.items()}
    given |= {
        (WorkerConfig, "graceful_shutdown_s"): k8s["graceful_shutdown"],
        (FrontendConfig, "namespace"): ns,
        (WorkerConfig, "namespace"): ns,
        (PlanesConfig, "start_wait_s"): float(k8s["startup_timeout"]),
        (AuthConfig, "api_keys"): api_keys,
    }
    if k8s["frontend_replicas"] > 1:  # the pods' routers see one in-flight load
        given[(FrontendConfig, "replica_sync")] = True
    return given


def _key_secrets(values: dict[str, Any], names: Names) -> tuple[list[SecretSource], tuple[str, ...]]:
    """The cluster secret's and the API keys' Secrets (their files read and checked here, never written), and the
    keys; `--api-key VALUE` refused (it would be in the manifests)."""
    secrets = [_cluster_secret(names, values.pop("cluster_secret_file"))]
    if values.pop("api_key"):
        raise ConfigError("--api-key would write a key into the manifests; put the keys in a file: --api-key-file")
    key_file = values.pop("api_key_file")
    api_keys = read_api_keys([], key_file, {}).keys if key_file else ()
    if key_file:
        secrets.append(SecretSource(names.api_keys, ((API_KEYS_KEY, key_file),)))
    return secrets, tuple(api_keys)


def _check_flags(values: dict[str, Any], k8s: dict[str, Any]) -> None:
    """Render's own flags that are wrong alone, or wrong with `dyn serve`'s."""
    if k8s["service_type"] not in SERVICE_TYPES:
        raise ConfigError(f"--service-type '{k8s['service_type']}' is invalid; use one of {', '.join(SERVICE_TYPES)}")
    for flag in ("gpus_per_worker", "prefill_gpus_per_worker"):
        if (k8s[flag] or 0) < 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 0, got {k8s[flag]}")
    if k8s["service_type"] != "ClusterIP" and not values["api_key_file"] and not k8s["allow_public"]:
        raise ConfigError(
            f"--service-type {k8s['service_type']} with no --api-key-file serves the API, the Files/Batch API and "
            "/metrics to anyone who reaches the node or the load balancer; add --api-key-file, or --allow-public"
        )
    if k8s["hostname"] and k8s["gateway"] is None:
        raise ConfigError("--hostname needs --gateway (it is the HTTPRoute's)")
    if k8s["planes_replicas"] not in (1, 3, 5):
        raise ConfigError(f"--planes-replicas must be 1, 3 or 5 (a quorum), got {k8s['planes_replicas']}")
    if k8s["frontend_replicas"] < 1:
        raise ConfigError(f"--frontend-replicas must be >= 1, got {k8s['frontend_replicas']}")
    db = values["batch_db"]
    if k8s["frontend_replicas"] > 1 and not (db == "off" or str(db).startswith("postgresql://")):
        raise ConfigError(
            "--frontend-replicas > 1 needs --batch-db postgresql://... (or off): a SQLite batch database's volume "
            "attaches to one pod"
        )
    if values["port"] == 0:
        raise ConfigError("--port 0 (any free port) cannot be a Service's port; give the frontend's port")
    if values["planner"]:
        refuse_pool_counts(
            values, "--planner", "the planner", "give the pools' floor with --planner-min-workers {count}"
        )
    _check_split_flags(values, k8s)


def refuse_pool_counts(values: dict[str, Any], flag: str, scaler: str, hint: str) -> None:
    """With a scaler that sizes the worker pools (`flag`: `--planner`, `--keda-prometheus`), a worker count above 1 is
    refused, `hint` (its `{count}` filled in) naming the scaler's own bound: rendered, the count would be reset by
    every re-apply; left out, the pool starts at 1."""
    given = [(name, values[key]) for name, key in POOL_SIZES if (values[key] or 1) > 1]
    if given:
        name, count = given[0]
        raise ConfigError(
            f"{name} {count} with {flag}: {scaler} sizes the pools (a count in the Deployment would be reset by "
            f"every kubectl apply); {hint.format(count=count)}"
        )


def _frontend_secrets(config: ServeConfig, plan: ServePlan | None, names: Names) -> list[SecretSource]:
    """The TLS Secret, and a refusal of a planner that could not read the frontend's /metrics."""
    tls = config.frontend.tls
    if plan is not None and (tls.is_enabled or config.frontend.auth.metrics_require_key):
        raise ConfigError(
            "--planner reads the frontend's /metrics over plain HTTP with no key: "
            "drop --tls-cert-file/--metrics-require-key, or run `dyn plan run` where it can reach /metrics"
        )
    if not tls.is_enabled:
        return []
    files = [("tls.crt", tls.cert_file), ("tls.key", tls.key_file), ("ca.crt", tls.ca_file)]
    return [SecretSource(names.tls, tuple((k, str(v)) for k, v in files if v is not None))]


def _grpc_port(port: int | None) -> int | None:
    if port == 0:
        raise ConfigError("--kserve-grpc-port 0 picks a port at run time; a Service needs a fixed one (e.g. 8787)")
    return port


def _cluster(config: ServeConfig, k8s: dict[str, Any], ns: str, names: Names, image: str) -> Cluster:
    return Cluster(
        namespace=ns,
        names=names,
        image=image,
        http_port=config.frontend.port,
        grpc_port=_grpc_port(config.frontend.kserve_grpc_port),
        service_type=k8s["service_type"],
        etcd_bundled=k8s["etcd"] == "bundled",
        nats_bundled=k8s["nats"] == "bundled",
        storage_class=k8s["storage_class"],
        planes_replicas=k8s["planes_replicas"],
        pod_monitor=k8s["pod_monitor"],
        gateway=_gateway(k8s["gateway"]),
        hostnames=tuple(k8s["hostname"] or ()),
        frontend_scheme=None if config.frontend.auth.metrics_require_key else config.frontend.scheme,
        metrics_namespace=k8s["metrics_namespace"],
    )


def _gateway(text: str | None) -> tuple[str | None, str] | None:
    """`--gateway [NAMESPACE/]NAME`."""
    if text is None:
        return None
    namespace, _, name = text.rpartition("/")
    return (check_name("--gateway", namespace) if namespace else None), check_name("--gateway", name)


def _placement(k8s: dict[str, Any]) -> Placement:
    return Placement(
        node_selector=tuple(_pair(item, "--node-selector", "LABEL=VALUE") for item in k8s["node_selector"] or ()),
        tolerations=tuple(_toleration(item) for item in k8s["toleration"] or ()),
        priority_class=k8s["priority_class"],
        image_pull_secrets=tuple(check_name("--image-pull-secret", n) for n in k8s["image_pull_secret"] or ()),
        ipc_lock=k8s["ipc_lock"],
    )


def _pair(item: str, flag: str, shape: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key or not value:
        raise ConfigError(f"{flag} '{item}' must be {shape}")
    return key, value


TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def _toleration(item: str) -> Toleration:
    """`KEY[=VALUE][:EFFECT]`."""
    rest, _, effect = item.rpartition(":") if ":" in item else (item, "", "")
    key, _, value = rest.partition("=")
    if not key or (effect and effect not in TOLERATION_EFFECTS):
        raise ConfigError(
            f"--toleration '{item}' must be KEY[=VALUE][:EFFECT], EFFECT one of {', '.join(TOLERATION_EFFECTS)}"
        )
    return Toleration(key, value or None, effect or None)


def _check_split_flags(values: dict[str, Any], k8s: dict[str, Any]) -> None:
    """Flags that act only with another, given without it: refused, not dropped (a render reads no DYN_*
    variable, so every value here was written on its command line or in --values)."""
    given = [flag for flag in PREFILL_ONLY if k8s[flag] is not None]
    if given and not values["disagg"]:
        raise ConfigError(f"--{given[0].replace('_', '-')} needs --disagg (it sets the prefill or decode pool)")
    planner = [k.name for k in serve.PLANNER_KNOBS if values[k.name] not in (None, k.default)]
    planner += ["planner_profile"] if values["planner_profile"] is not None else []
    if planner and not values["planner"]:
        raise ConfigError(f"--{planner[0].replace('_', '-')} needs --planner")


def _pools(config: ServeConfig, k8s: dict[str, Any]) -> dict[Role, PoolShape]:
    """Each pool's resources and own engine options: the prefill pool's flags over the worker flags."""
    extra = tuple(_pair(item, "--worker-resource", "NAME=QUANTITY") for item in k8s["worker_resource"] or ())
    disk = _disk_request(config)
    worker = Resources(k8s["worker_cpu"], k8s["worker_memory"], k8s["gpus_per_worker"], extra, disk)
    if not config.num_prefill_workers:
        return {Role.BOTH: PoolShape(worker, {})}
    prefill = Resources(
        k8s["prefill_worker_cpu"] or worker.cpu,
        k8s["prefill_worker_memory"] or worker.memory,
        k8s["prefill_gpus_per_worker"] if k8s["prefill_gpus_per_worker"] is not None else worker.gpus,
        worker.extra,
        worker.ephemeral_storage,
    )
    return {
        Role.DECODE: PoolShape(worker, o.engine_extra(k8s["decode_engine_arg"], None)),
        Role.PREFILL: PoolShape(prefill, o.engine_extra(k8s["prefill_engine_arg"], None)),
    }


def _disk_request(config: ServeConfig) -> str | None:
    """The disk KV tier's emptyDir, requested as ephemeral storage."""
    disk = config.worker.kv_tiers.disk_bytes
    return f"{-(-disk // 10**9)}G" if disk else None


def _model_source(worker: WorkerConfig, k8s: dict[str, Any]) -> ModelSource:
    """The mounts and variables the model needs; a hub model with nowhere to download to is refused (it would fill
    the pods' small /tmp and be evicted in a loop)."""
    model, mounts, env = worker.model, [], []
    secret_env = [SecretEnv("HF_TOKEN", k8s["hf_token_secret"], HF_TOKEN_KEY)] if k8s["hf_token_secret"] else []
    if k8s["model_pvc"] is not None:
        mounts.append(Mount("model", MODELS_DIR, claim=k8s["model_pvc"]))
    if k8s["model_cache_pvc"] is not None:
        mounts.append(Mount("model-cache", MODEL_CACHE_DIR, claim=k8s["model_cache_pvc"], shared=True))
        env.append(("HF_HOME", MODEL_CACHE_DIR))
    is_hub = model not in MODEL_ALIASES and not model.startswith("/")
    if is_hub and k8s["model_cache_pvc"] is None:
        raise ConfigError(
            f"--model '{model}' is a hub id: give --model-cache-pvc CLAIM (a ReadWriteMany claim the workers "
            f"download it into and the frontend reads its tokenizer from), or put the files on --model-pvc and pass "
            f"--model {MODELS_DIR}/DIR (or a path baked into --image)"
        )
    if k8s["model_pvc"] is not None and not is_hub and model not in MODEL_ALIASES:
        if not (model == MODELS_DIR or model.startswith(f"{MODELS_DIR}/")):
            raise ConfigError(f"--model-pvc is mounted at {MODELS_DIR}: --model '{model}' must be a path under it")
    return ModelSource(tuple(mounts), tuple(env), tuple(secret_env))


def _check_worker_fit(worker: WorkerConfig, pools: dict[Role, PoolShape], model: ModelSource) -> None:
    """Refuse what a worker pod could not run as rendered: a GPU engine with no GPU, a host KV tier over the
    memory limit, a LoRA adapter at a path of this machine."""
    for role, pool in pools.items():
        if worker.engine in GPU_ENGINES and pool.resources.gpus < 1:
            pool_name = "" if role is Role.BOTH else f" ({role.value} pool)"
            raise ConfigError(
                f"--engine {worker.engine} runs on GPUs: give --gpus-per-worker N{pool_name} (the mocker and "
                "llamacpp run on CPU)"
            )
        memory = _quantity_bytes(pool.resources.memory)
        if memory is not None and worker.kv_tiers.host_bytes >= memory:
            raise ConfigError(
                f"--kv-host-cache-gb {worker.kv_tiers.host_bytes / 1e9:g} does not fit in the worker's memory limit "
                f"({pool.resources.memory}); raise --worker-memory or lower the tier"
            )
    mounted = [m.path for m in model.mounts]
    for spec in worker.lora.adapters:
        _, _, path = spec.partition("=")
        if not any(path == root or path.startswith(f"{root}/") for root in mounted):
            raise ConfigError(
                f"--lora {spec}: a pod sees only its mounts; put the adapter on --model-pvc ({MODELS_DIR}) or "
                f"--model-cache-pvc ({MODEL_CACHE_DIR}) and name it there"
            )


def _quantity_bytes(quantity: str) -> int | None:
    """A Kubernetes memory quantity (`8Gi`, `500M`, `1e9`) in bytes; None when it is not one of those forms."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            number = quantity.removesuffix(suffix)
            return int(float(number) * factor) if _is_number(number) else None
    return int(float(quantity)) if _is_number(quantity) else None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _env_pair(item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not ENV_NAME.fullmatch(name):
        raise ConfigError(f"--env '{item}' must be NAME=VALUE with NAME of letters, digits and '_'")
    if name.startswith("DYN_"):
        raise ConfigError(f"--env {name}: DYN_* variables are dyn's settings; pass the flag itself")
    return name, value


def _check_image(image: str) -> None:
    """A tag or digest that names one build: never `latest`, never none."""
    name, _, tag = image.rpartition(":") if "@" not in image else (image, "", "digest")
    if not name or "/" in tag or tag in ("", "latest"):
        raise ConfigError(f"--image '{image}' must carry a pinned tag or digest (not latest), e.g. dyn:{__version__}")


def _cluster_secret(names: Names, path: Path | None) -> SecretSource:
    """The request plane's secret: the file given (checked as `dyn serve` checks it), else a new random one."""
    if path is None:
        return SecretSource(names.cluster_secret, random_key=CLUSTER_SECRET_KEY)
    o.cluster_secret(path)
    return SecretSource(names.cluster_secret, ((CLUSTER_SECRET_KEY, str(path)),))


##### Components: the pods' command lines #####
