"""Options shared by several commands (each with its DYN_* environment twin) and their parsing."""

from __future__ import annotations

import json
import os
from importlib.util import find_spec
from pathlib import Path
from typing import Annotated, Any

import typer

from dynamo_cli.config import (
    CLUSTER_SECRET_ENV,
    DEFAULT_ENGINE,
    DEFAULT_MODEL,
    DEFAULT_NAMESPACE,
    DISAGG_POLICIES,
    KV_TRANSFERS,
    DisaggConfig,
    KvRouterConfig,
    PlanesConfig,
    QueueConfig,
    QueuePolicy,
)
from dynamo_cli.engine import Role, registered_engines
from dynamo_cli.errors import ConfigError
from dynamo_cli.kv.tiers import KvTierConfig
from dynamo_cli.router.tiers import parse_tier_weights
from dynamo_cli.runtime.handshake import MIN_SECRET_BYTES, new_secret

_LIBRARY = {"vllm": "vllm", "sglang": "sglang", "trtllm": "tensorrt_llm", "llamacpp": "llama_cpp"}


def engines_help() -> str:
    """`mocker (installed), vllm (not installed: pip install 'dynamo-cli[vllm]')...`"""
    parts = []
    for name in sorted(registered_engines()):
        library = _LIBRARY.get(name)
        ok = library is None or find_spec(library) is not None
        status = "installed" if ok else "needs pip install 'dynamo-cli\\[" + name + "]'"  # \[: not rich markup
        parts.append(f"{name} ({status})")
    return "Engine plugin: " + ", ".join(parts)


Engine = Annotated[str, typer.Option("--engine", "-e", envvar="DYN_ENGINE", help=engines_help())]
Model = Annotated[
    str, typer.Option("--model", "-m", envvar="DYN_MODEL", help="Model alias (smollm2), GGUF file or HF dir.")
]
ServedName = Annotated[
    str | None, typer.Option("--served-model-name", envvar="DYN_SERVED_MODEL_NAME", help="Name clients use.")
]
Namespace = Annotated[str, typer.Option("--namespace", envvar="DYN_NAMESPACE", help="Deployment namespace.")]
Discovery = Annotated[
    str,
    typer.Option("--discovery", envvar="DYN_DISCOVERY", help="embedded | file:///DIR | etcd://HOST:PORT[,HOST:PORT]"),
]
Events = Annotated[str, typer.Option("--events", envvar="DYN_EVENTS", help="embedded | nats://HOST:PORT")]
LeaseTtl = Annotated[float, typer.Option("--lease-ttl", envvar="DYN_LEASE_TTL", help="Discovery lease TTL (s).")]
BlockSize = Annotated[
    int | None, typer.Option("--block-size", envvar="DYN_KV_CACHE_BLOCK_SIZE", help="KV block size in tokens.")
]
ContextLength = Annotated[int | None, typer.Option("--context-length", envvar="DYN_CONTEXT_LENGTH")]
SpeedupRatio = Annotated[
    float | None, typer.Option("--speedup-ratio", envvar="DYN_SPEEDUP_RATIO", help="mocker: divide simulated time.")
]
NumGpuBlocks = Annotated[
    int | None, typer.Option("--num-gpu-blocks", envvar="DYN_NUM_GPU_BLOCKS", help="mocker: KV capacity in blocks.")
]
Deterministic = Annotated[
    bool,
    typer.Option(
        "--deterministic",
        envvar="DYN_DETERMINISTIC",
        help="Greedy output independent of batching, prefix hits and migration (engine option deterministic=true;"
        " slower).",
    ),
]
MaxNumSeqs = Annotated[int | None, typer.Option("--max-num-seqs", envvar="DYN_MAX_NUM_SEQS")]
EngineArg = Annotated[
    list[str] | None,
    typer.Option("--engine-arg", envvar="DYN_ENGINE_ARG", help="Engine option KEY=VALUE (repeatable; JSON values)."),
]
ExtraEngineArgs = Annotated[
    str | None,
    typer.Option("--extra-engine-args", envvar="DYN_EXTRA_ENGINE_ARGS", help="JSON object of engine options."),
]

DEFAULTS = {"engine": DEFAULT_ENGINE, "model": DEFAULT_MODEL, "namespace": DEFAULT_NAMESPACE}
KV_ROUTER = KvRouterConfig()
"""The router flags' defaults (immutable): KvRouterConfig is the one place they are set."""


_KV_TIERS = "KV tiers (host memory and disk below the engine's cache)"
KvHostCacheGb = Annotated[
    float,
    typer.Option(
        "--kv-host-cache-gb",
        envvar="DYN_KV_HOST_CACHE_GB",
        rich_help_panel=_KV_TIERS,
        help="KV tier in host memory below the engine's cache, GB (0: off).",
    ),
]
KvDiskCacheGb = Annotated[
    float,
    typer.Option(
        "--kv-disk-cache-gb",
        envvar="DYN_KV_DISK_CACHE_GB",
        rich_help_panel=_KV_TIERS,
        help="KV tier on local disk below host memory, GB (0: off).",
    ),
]
KvDiskCacheDir = Annotated[
    str | None,
    typer.Option(
        "--kv-disk-cache-dir",
        envvar="DYN_KV_DISK_CACHE_DIR",
        rich_help_panel=_KV_TIERS,
        help="Directory of the disk KV tier; kept across restarts (default: a temporary one).",
    ),
]
KvDiskOffloadFilter = Annotated[
    bool,
    typer.Option(
        "--kv-disk-offload-filter/--no-kv-disk-offload-filter",
        envvar="DYN_KV_DISK_OFFLOAD_FILTER",
        rich_help_panel=_KV_TIERS,
        help="Move host→disk only KV blocks reused at least once (Dynamo's default).",
    ),
]


def kv_tiers(host_gb: float, disk_gb: float, disk_dir: str | None, offload_filter: bool) -> KvTierConfig:
    """The `--kv-*-cache-*` flags as a KvTierConfig (GB = 10^9 bytes, as Dynamo's DYN_KVBM_*_CACHE_GB)."""
    if host_gb < 0 or disk_gb < 0:
        raise ConfigError(f"--kv-host-cache-gb {host_gb} / --kv-disk-cache-gb {disk_gb} must be >= 0")
    if disk_dir is not None and disk_gb <= 0:
        raise ConfigError("--kv-disk-cache-dir needs --kv-disk-cache-gb > 0")
    return KvTierConfig(int(host_gb * 1e9), int(disk_gb * 1e9), disk_dir, offload_filter)


def planner_option(flag: str, help: str, *, prefix: str = "") -> Any:
    """A planner option with its DYN_PLANNER_* twin: `--FLAG` on `dyn plan run`, `--planner-FLAG` on `dyn serve`
    (prefix "planner-"), one environment variable for both."""
    name = flag.strip("-")
    return typer.Option(f"--{prefix}{name}", envvar="DYN_PLANNER_" + name.upper().replace("-", "_"), help=help)


def parse_role(value: str) -> Role:
    try:
        return Role(value)
    except ValueError:
        raise ConfigError(f"--role '{value}' is invalid; use one of: prefill, decode, both") from None


def planes(discovery: str, events: str, lease_ttl: float, secret: bytes | None = None) -> PlanesConfig:
    if lease_ttl <= 0:
        raise ConfigError(f"--lease-ttl must be positive, got {lease_ttl}")
    return PlanesConfig(discovery=discovery, events=events, lease_ttl=lease_ttl, cluster_secret=secret)


def engine_extra(engine_args: list[str] | None, extra_json: str | None, **named: Any) -> dict[str, Any]:
    """Merge --extra-engine-args JSON, then --engine-arg KEY=VALUE, then named flags that were given."""
    extra: dict[str, Any] = {}
    if extra_json:
        try:
            loaded = json.loads(extra_json)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--extra-engine-args is not valid JSON: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError("--extra-engine-args must be a JSON object")
        extra.update(loaded)
    for item in engine_args or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--engine-arg '{item}' must look like KEY=VALUE")
        try:
            extra[key.replace("-", "_")] = json.loads(raw)
        except json.JSONDecodeError:
            extra[key.replace("-", "_")] = raw
    extra.update({k: v for k, v in named.items() if v is not None})
    return extra


OverlapWeight = Annotated[
    float,
    typer.Option(
        "--kv-overlap-score-weight",
        envvar="DYN_KV_OVERLAP_SCORE_WEIGHT",
        help="KV router: weight of prefill blocks in the cost.",
    ),
]
RouterTemperature = Annotated[
    float,
    typer.Option(
        "--router-temperature", envvar="DYN_ROUTER_TEMPERATURE", help="KV router: 0 = argmin, > 0 = softmax sampling."
    ),
]
KvEvents = Annotated[
    bool,
    typer.Option(
        "--kv-events/--no-kv-events",
        envvar="DYN_KV_EVENTS",
        help="KV router: use workers' KV events, or approximate from own decisions.",
    ),
]
HotSpotGuard = Annotated[
    bool,
    typer.Option(
        "--hot-spot-guard/--no-hot-spot-guard",
        envvar="DYN_HOT_SPOT_GUARD",
        help="KV router: pick by load when load is badly imbalanced.",
    ),
]
RouterTtl = Annotated[
    float,
    typer.Option(
        "--router-ttl",
        envvar="DYN_ROUTER_TTL_SECS",
        help="KV router, approximate mode: seconds a routed prefix counts as cached.",
    ),
]


RouterCost = Annotated[
    str,
    typer.Option(
        "--router-cost",
        envvar="DYN_ROUTER_COST",
        help="KV router cost: time (seconds of prefill, evictions, KV wait) | dynamo (w*prefill + decode).",
    ),
]
RouterPrefillTps = Annotated[
    float | None,
    typer.Option(
        "--router-prefill-tps",
        envvar="DYN_ROUTER_PREFILL_TPS",
        help="KV router, time cost: a worker's prefill tokens/s (default: learned from first tokens).",
    ),
]


RouterTierWeights = Annotated[
    str,
    typer.Option(
        "--router-tier-weights",
        envvar="DYN_ROUTER_TIER_WEIGHTS",
        help="KV router, dynamo cost: worth of a host/disk hit vs a device hit, host=W,disk=W "
        "(default: from the bandwidths).",
    ),
]
RouterHostGbs = Annotated[
    float,
    typer.Option(
        "--router-host-bandwidth-gbs",
        envvar="DYN_ROUTER_HOST_BANDWIDTH_GBS",
        help="KV router: GB/s of an onboard from the host-memory tier.",
    ),
]
RouterDiskGbs = Annotated[
    float,
    typer.Option(
        "--router-disk-bandwidth-gbs",
        envvar="DYN_ROUTER_DISK_BANDWIDTH_GBS",
        help="KV router: GB/s of an onboard from the disk tier.",
    ),
]


def kv_router(
    block_size: int | None,
    weight: float,
    temperature: float,
    kv_events: bool,
    hot_spot_guard: bool,
    ttl: float,
    cost: str = KV_ROUTER.cost,
    prefill_tps: float | None = KV_ROUTER.prefill_tokens_per_s,
    tier_weights: str = "",
    host_gbs: float = KV_ROUTER.host_bandwidth_gbs,
    disk_gbs: float = KV_ROUTER.disk_bandwidth_gbs,
) -> KvRouterConfig:
    """The KV router's settings from its flags, checked now (a bad value is a ConfigError at start)."""
    return KvRouterConfig(
        block_size=block_size,
        overlap_score_weight=weight,
        temperature=temperature,
        use_kv_events=kv_events,
        hot_spot_guard=hot_spot_guard,
        approx_ttl_s=ttl,
        cost=cost,
        prefill_tokens_per_s=prefill_tps,
        tier_weights=parse_tier_weights(tier_weights),
        host_bandwidth_gbs=host_gbs,
        disk_bandwidth_gbs=disk_gbs,
    )


##### Disaggregation (shared by `dyn serve` and `dyn router`) #####

_D = DisaggConfig()
DisaggPolicy = Annotated[
    str,
    typer.Option(
        "--disagg-policy",
        envvar="DYN_DISAGG_POLICY",
        help="When a prompt is prefilled on a prefill worker: " + " | ".join(DISAGG_POLICIES),
    ),
]
MaxLocalPrefill = Annotated[
    int,
    typer.Option(
        "--max-local-prefill-length",
        envvar="DYN_MAX_LOCAL_PREFILL_LENGTH",
        help="Uncached prompt tokens a decode worker prefills itself.",
    ),
]
MaxPrefillQueue = Annotated[
    int,
    typer.Option(
        "--max-prefill-queue",
        envvar="DYN_MAX_PREFILL_QUEUE",
        help="Policies load, isl-or-load: prefills queued on a prefill worker when it counts saturated.",
    ),
]
DecodeBusy = Annotated[
    float,
    typer.Option(
        "--decode-busy-threshold",
        envvar="DYN_DECODE_BUSY_THRESHOLD",
        help="KV usage of a decode worker above which long prompts always go to a prefill worker.",
    ),
]
EnforceDisagg = Annotated[
    bool,
    typer.Option(
        "--enforce-disagg",
        envvar="DYN_ENFORCE_DISAGG",
        help="Never prefill on a decode worker: no prefill worker → 503.",
    ),
]
KvTransfer = Annotated[
    str, typer.Option("--kv-transfer", envvar="DYN_KV_TRANSFER", help="How KV is pulled: " + " | ".join(KV_TRANSFERS))
]
PrefillRouterMode = Annotated[
    str | None,
    typer.Option(
        "--prefill-router-mode",
        envvar="DYN_PREFILL_ROUTER_MODE",
        help="kv | round-robin | random for the prefill hop (default: --router's).",
    ),
]


def disagg(
    policy: str, max_local: int, max_queue: int, decode_busy: float, enforce: bool, prefill_mode: str | None
) -> DisaggConfig:
    """Disaggregation's settings from its flags, checked now."""
    return DisaggConfig(
        policy=policy,
        max_local_prefill_length=max_local,
        max_prefill_queue=max_queue,
        decode_busy_threshold=decode_busy,
        enforce=enforce,
        prefill_router_mode=prefill_mode,
    )


##### The wait queue (every worker busy) #####

_Q = QueueConfig()
QueueSize = Annotated[
    int,
    typer.Option(
        "--router-queue-size",
        envvar="DYN_ROUTER_QUEUE_SIZE",
        help="Requests that may wait per model when every worker is busy (0: 503 at once).",
    ),
]
QueueTimeout = Annotated[
    float,
    typer.Option(
        "--router-queue-timeout",
        envvar="DYN_ROUTER_QUEUE_TIMEOUT",
        help="Seconds a request waits for a worker before its 503.",
    ),
]
QueuePolicyOption = Annotated[
    str,
    typer.Option(
        "--router-queue-policy",
        envvar="DYN_ROUTER_QUEUE_POLICY",
        help="Order of waiting requests, after x-dyn-priority: fcfs | sjf | deadline.",
    ),
]


MaxInflightPerWorker = Annotated[
    int,
    typer.Option(
        "--max-inflight-per-worker",
        envvar="DYN_MAX_INFLIGHT_PER_WORKER",
        help="Busy threshold: streams per worker (0: none); all workers busy → the wait queue, then 503.",
    ),
]
ActiveBlocksThreshold = Annotated[
    float,
    typer.Option(
        "--active-decode-blocks-threshold",
        envvar="DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD",
        help="Busy threshold: KV usage fraction (1.0: off).",
    ),
]


def queue(size: int, timeout: float, policy: str) -> QueueConfig:
    """The wait queue's settings from its flags, checked now."""
    if size < 0 or not timeout > 0:
        raise ConfigError(f"--router-queue-size must be >= 0 ({size}) and --router-queue-timeout > 0 ({timeout})")
    try:
        order = QueuePolicy(policy)
    except ValueError:
        choices = " | ".join(p.value for p in QueuePolicy)
        raise ConfigError(f"--router-queue-policy '{policy}' is not one of {choices}") from None
    return QueueConfig(max_size=size, max_wait_s=timeout, policy=order)


##### The cluster secret (request-plane authentication) #####

ClusterSecretFile = Annotated[
    Path | None,
    typer.Option(
        "--cluster-secret-file",
        envvar="DYN_CLUSTER_SECRET_FILE",
        help="File (mode 600) holding the request plane's shared secret in hex, the same on every node"
        " (make one: openssl rand -hex 32). Default: DYN_CLUSTER_SECRET; without either, `dyn serve` makes one"
        " and `dyn worker`/`dyn router` listen on loopback only.",
    ),
]


def cluster_secret(path: Path | None, *, make: bool = False) -> bytes | None:
    """The cluster secret: `--cluster-secret-file`, else DYN_CLUSTER_SECRET (hex), else a new random one
    if `make` (`dyn serve`: one per deployment), else None (the request plane then stays on loopback)."""
    if path is not None:
        return _parse_secret(_read_private(path), f"--cluster-secret-file {path}")
    text = os.environ.get(CLUSTER_SECRET_ENV, "").strip()
    if text:
        return _parse_secret(text, CLUSTER_SECRET_ENV)
    return new_secret() if make else None


def _read_private(path: Path) -> str:
    """The file's text; ConfigError if it is unreadable or other users may read it (as ssh does with keys)."""
    try:
        mode = path.stat().st_mode
        text = path.read_text(errors="replace")
    except OSError as exc:
        raise ConfigError(f"--cluster-secret-file {path} cannot be read: {exc.strerror or exc}") from None
    if mode & 0o077:
        raise ConfigError(
            f"--cluster-secret-file {path} is open to other users (mode {mode & 0o777:o}); run: chmod 600 {path}"
        )
    return text


def _parse_secret(text: str, source: str) -> bytes:
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise ConfigError(f"the cluster secret from {source} is not hex; make one with: openssl rand -hex 32") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the cluster secret from {source} has {len(secret)} bytes, fewer than"
            f" {MIN_SECRET_BYTES}; make one with: openssl rand -hex 32"
        )
    return secret
