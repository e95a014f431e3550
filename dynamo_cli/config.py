"""One frozen dataclass per role. Precedence: flag > DYN_* environment (Typer reads it) > default."""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dynamo_cli.engine import KvTierConfig, Role
from dynamo_cli.errors import ConfigError
from dynamo_cli.model_card import ModelCard

DEFAULT_NAMESPACE = "dynamo"
DEFAULT_MODEL = "smollm2"
DEFAULT_ENGINE = "mocker"
CLUSTER_SECRET_ENV = "DYN_CLUSTER_SECRET"
"""The cluster secret as hex: read by every command, set by `dyn serve` for the processes it starts."""


ROUTER_COSTS = ("time", "dynamo")
"""`--router-cost`: the KV router's cost function."""
KV_BYTES_PER_TOKEN = 131_072
"""KV bytes per token when the card does not say (Llama-3-8B fp16; router/tiers.py has the derivation)."""


TIER_HOST_GBS = 20.0
"""GB/s of a KV onboard from host memory: pinned copies over PCIe 4.0 x16 (~25 peak, 20 sustained). One
figure for the router's cost (router/tiers.py) and the mocker's timing model, so they agree by default."""
TIER_DISK_GBS = 4.0
"""GB/s of a KV onboard from local disk: one NVMe Gen4 SSD's sequential read (3-7 GB/s)."""
TIER_HOST_LATENCY_S = 20e-6
"""Fixed cost of one host -> device transfer (a copy's launch and synchronisation)."""
TIER_DISK_LATENCY_S = 200e-6
"""Fixed cost of one disk -> device transfer (an NVMe read's queueing and completion, plus the hop
through host memory)."""


@dataclass(frozen=True, slots=True)
class KvRouterConfig:
    """Settings of the KV-aware router (flags `--block-size`, `--kv-overlap-score-weight` ...).

    The one place of each router default: the CLI flags, `dyn serve`'s `dyn router` command line and
    the frontend's and router's policies all read them from here.
    """

    block_size: int | None = None
    """Tokens per KV block; must equal the workers' block size. None = the one on the workers' card."""
    cost: str = "time"
    """`time`: seconds of prefill, evictions and KV queueing (router/time_cost.py); `dynamo`: Dynamo's
    `w * prefill_blocks + decode_blocks`."""
    overlap_score_weight: float = 1.0
    """`dynamo` cost: w in `w * prefill_blocks + decode_blocks`; 0 = pure load balancing."""
    prefill_tokens_per_s: float | None = None
    """`time` cost: a worker's prefill speed; None = learned from the first tokens the router sees."""
    total_kv_blocks: int | None = None
    """`time` cost: a worker's KV capacity until it publishes its own; None = the card's."""
    temperature: float = 0.0
    """0 = argmin; > 0 = softmax sampling over normalised logits."""
    use_kv_events: bool = True
    """False = approximate mode: the router's own decisions stand in for the workers' caches."""
    hot_spot_guard: bool = True
    """Ignore the cache and pick by load when active blocks are badly imbalanced."""
    hot_spot_min_blocks: int = 512
    """Hot-spot absolute threshold: max - min active blocks."""
    hot_spot_ratio: float = 0.5
    """Hot-spot relative threshold: (max - min) / max active blocks."""
    approx_ttl_s: float = 120.0
    """Approximate mode: seconds a routed prefix is presumed cached."""
    approx_max_blocks: int = 1 << 20
    """Approximate mode: entries kept before pruning to 80 %."""
    host_bandwidth_gbs: float = TIER_HOST_GBS
    """GB/s of an onboard from host memory (PCIe 4.0 x16 pinned copies; router/tiers.py)."""
    disk_bandwidth_gbs: float = TIER_DISK_GBS
    """GB/s of an onboard from local disk (one NVMe Gen4 SSD; router/tiers.py)."""
    tier_weights: tuple[tuple[str, float], ...] = ()
    """`dynamo` cost: (tier, weight) of a host or disk hit against a device hit; unset = from bandwidths."""
    kv_bytes_per_block: int | None = None
    """KV bytes of one block; None = the card's, else KV_BYTES_PER_TOKEN per token."""

    def __post_init__(self) -> None:
        checks = [
            (self.block_size is None or self.block_size > 0, "block_size", self.block_size, "use the workers' one"),
            (self.cost in ROUTER_COSTS, "cost", self.cost, "use one of: " + ", ".join(ROUTER_COSTS)),
            (self.overlap_score_weight >= 0, "overlap_score_weight", self.overlap_score_weight, "use >= 0"),
            (
                self.prefill_tokens_per_s is None or self.prefill_tokens_per_s > 0,
                "prefill_tokens_per_s",
                self.prefill_tokens_per_s,
                "use a positive speed or leave it unset to learn it",
            ),
            (self.temperature >= 0, "temperature", self.temperature, "use 0 (argmin) or a positive value"),
            (self.hot_spot_min_blocks >= 1, "hot_spot_min_blocks", self.hot_spot_min_blocks, "use >= 1"),
            (0 <= self.hot_spot_ratio <= 1, "hot_spot_ratio", self.hot_spot_ratio, "use a value in [0, 1]"),
            (self.approx_ttl_s > 0, "approx_ttl_s", self.approx_ttl_s, "use a positive number of seconds"),
            (self.approx_max_blocks > 0, "approx_max_blocks", self.approx_max_blocks, "use >= 1"),
            (self.host_bandwidth_gbs > 0, "host_bandwidth_gbs", self.host_bandwidth_gbs, "use a positive GB/s"),
            (self.disk_bandwidth_gbs > 0, "disk_bandwidth_gbs", self.disk_bandwidth_gbs, "use a positive GB/s"),
            (
                all(t in ("host", "disk") and 0 <= w <= 1 for t, w in self.tier_weights),
                "tier_weights",
                self.tier_weights,
                "use host=W,disk=W with W in [0, 1]",
            ),
        ]
        for ok, name, value, fix in checks:
            if not ok:
                raise ConfigError(f"router {name} ({value}) is invalid; {fix}")

    def for_card(self, card: ModelCard) -> KvRouterConfig:
        """This config with the card's block size, KV capacity and KV bytes per block, unless they were set."""
        block_size = self.block_size if self.block_size is not None else card.kv_cache_block_size
        total = self.total_kv_blocks if self.total_kv_blocks is not None else card.total_kv_blocks
        nbytes = self.kv_bytes_per_block or card.kv_bytes_per_block or KV_BYTES_PER_TOKEN * block_size
        return replace(self, block_size=block_size, total_kv_blocks=total, kv_bytes_per_block=nbytes)


KV_TRANSFERS = ("auto", "tcp", "nixl")
"""`--kv-transfer`: NIXL when it imports, else TCP; or either one."""
DISAGG_POLICIES = ("adaptive", "always", "isl", "load", "isl-or-load")


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """When a request's prompt is prefilled on a prefill worker rather than on its decode worker
    (`--disagg-policy` ...; router/disagg.py has the rules). Applies to a model that has prefill workers."""

    policy: str = "adaptive"
    """`adaptive` (default: weighs both pools' queued prefill work), `always`, `isl` (Dynamo's
    isl_bounding), `load` (prefill_load) or `isl-or-load` (isl_or_load)."""
    max_local_prefill_length: int = 512
    """Uncached prompt tokens on the decode worker (effective ISL) at or below which it prefills locally."""
    max_prefill_queue: int = 4
    """`load`, `isl-or-load`: a prefill worker with this many prefills queued is saturated; all saturated
    → prefill locally."""
    decode_busy_threshold: float = 0.9
    """Circuit breaker: a decode worker whose KV is this full never prefills a long prompt locally."""
    enforce: bool = False
    """`--enforce-disagg`: no prefill worker → 503 naming the pool, never an aggregated fallback."""
    prefill_router_mode: str | None = None
    """Routing of the prefill hop (`kv`, `round-robin`, `random`); None = the frontend's `--router`."""

    def __post_init__(self) -> None:
        if self.policy not in DISAGG_POLICIES:
            raise ConfigError(f"--disagg-policy '{self.policy}' is unknown; use one of: {', '.join(DISAGG_POLICIES)}")
        if self.max_local_prefill_length < 0 or self.max_prefill_queue < 1:
            raise ConfigError(
                f"--max-local-prefill-length ({self.max_local_prefill_length}) must be >= 0 and "
                f"--max-prefill-queue ({self.max_prefill_queue}) >= 1"
            )
        if not 0 < self.decode_busy_threshold <= 1:
            raise ConfigError(f"--decode-busy-threshold ({self.decode_busy_threshold}) must be in (0, 1]")
        if self.prefill_router_mode not in (None, "kv", "round-robin", "random"):
            raise ConfigError(
                f"--prefill-router-mode '{self.prefill_router_mode}' is unknown; use kv, round-robin or random"
            )


@dataclass(frozen=True, slots=True)
class PlanesConfig:
    """Where the discovery and event planes are."""

    discovery: str = "embedded"
    """`embedded`, `file:///DIR` or `etcd://HOST:PORT[,HOST:PORT]`."""
    events: str = "embedded"
    """`embedded` (ZMQ advertised via discovery) or `nats://HOST:PORT`."""
    lease_ttl: float = 10.0
    """Seconds before a dead process's keys vanish."""
    cluster_secret: bytes | None = field(default=None, repr=False)
    """The request plane's shared secret (`--cluster-secret-file`, DYN_CLUSTER_SECRET; `dyn serve` makes
    one); every connection authenticates with it. None = unauthenticated, allowed on loopback only."""


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """`dyn worker`."""

    engine: str
    """Registry name of the engine plugin."""
    model: str
    served_model_name: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    component: str = "backend"
    """Defaults by role: `backend` (both), `prefill`, `decode`... kept explicit here."""
    endpoint: str = "generate"
    role: Role = Role.BOTH
    host: str = "127.0.0.1"
    """Address the request plane listens on and advertises."""
    port: int = 0
    block_size: int | None = None
    context_length: int | None = None
    graceful_shutdown_s: float = 5.0
    """How long SIGTERM waits for in-flight streams after deregistering."""
    planes: PlanesConfig = field(default_factory=PlanesConfig)
    extra: dict[str, Any] = field(default_factory=dict)
    """Engine-specific options (speedup_ratio, num_gpu_blocks, n_ctx...)."""
    kv_transfer: str = "auto"
    """How decode workers pull prefilled KV: `tcp`, `nixl`, or `auto` (NIXL when it imports, else TCP)."""
    kv_transfer_port: int = 0
    """Port of a prefill worker's KV transfer server (0: any free port), on `host`."""
    kv_transfer_ttl_s: float = 30.0
    """Seconds a prefill worker keeps KV no decode worker pulled (the client left, the decode died)."""
    kv_tiers: KvTierConfig = field(default_factory=KvTierConfig)
    """Host and disk KV tiers below the engine's cache (`--kv-host-cache-gb`, `--kv-disk-cache-gb` ...)."""

    def __post_init__(self) -> None:
        if self.kv_transfer not in KV_TRANSFERS or self.kv_transfer_ttl_s <= 0:
            raise ConfigError(
                f"--kv-transfer '{self.kv_transfer}' / --kv-transfer-ttl {self.kv_transfer_ttl_s} "
                f"is invalid; use one of {', '.join(KV_TRANSFERS)} and a positive number of "
                "seconds"
            )


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """HTTPS on the frontend (`--tls-cert-file`, `--tls-key-file`), mutual TLS with `--tls-ca-file`."""

    cert_file: str | None = None
    """PEM certificate chain the frontend presents; None = plain HTTP."""
    key_file: str | None = None
    """PEM private key of `cert_file`."""
    ca_file: str | None = None
    """PEM CA bundle: clients must present a certificate it signed (ssl.CERT_REQUIRED); None = no client certs."""

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            given, missing = (
                ("--tls-cert-file", "--tls-key-file") if self.cert_file else ("--tls-key-file", "--tls-cert-file")
            )
            raise ConfigError(f"{given} was given without {missing}; pass both (or neither, for plain HTTP)")
        if self.ca_file is not None and self.cert_file is None:
            raise ConfigError("--tls-ca-file (mutual TLS) needs --tls-cert-file and --tls-key-file")
        for flag, path in (
            ("--tls-cert-file", self.cert_file),
            ("--tls-key-file", self.key_file),
            ("--tls-ca-file", self.ca_file),
        ):
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{flag} '{path}' is not a readable file; check the path")

    @property
    def is_enabled(self) -> bool:
        return self.cert_file is not None


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """API keys on the frontend and the limits each key gets (`--api-key`, `--api-key-rps`...)."""

    api_keys: tuple[str, ...] = ()
    """Accepted bearer keys; empty = no authentication (the default, bound to 127.0.0.1)."""
    rps: float = 0.0
    """Requests per second per key (token bucket, burst = max(1, rps)); 0 = no limit."""
    max_inflight: int = 0
    """Requests open at once per key; 0 = no limit."""
    metrics_require_key: bool = False
    """True: `/metrics` needs a key too (`/health` and `/live` are always open)."""

    def __post_init__(self) -> None:
        if self.rps < 0 or self.max_inflight < 0:
            raise ConfigError(
                f"--api-key-rps ({self.rps}) and --api-key-max-inflight ({self.max_inflight}) must be >= 0"
            )
        if not self.api_keys and (self.rps or self.max_inflight or self.metrics_require_key):
            raise ConfigError(
                "--api-key-rps, --api-key-max-inflight and --metrics-require-key need API keys; "
                "pass --api-key, --api-key-file or DYN_API_KEYS"
            )
        for key in self.api_keys:
            if not key.isascii() or not key.isprintable() or " " in key:
                raise ConfigError(
                    "an API key holds a space or a non-printable or non-ASCII character; "
                    "use printable ASCII keys (e.g. `openssl rand -hex 32`)"
                )


def read_api_keys(flags: Sequence[str], key_file: str | None, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The API keys: `--api-key` flags (else `DYN_API_KEYS`, comma-separated) plus `--api-key-file`'s lines.

    Blank lines and lines starting with `#` in the file are skipped; duplicates are dropped.
    """
    keys = list(flags) if flags else environ.get("DYN_API_KEYS", "").split(",")
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8") as f:
                keys += [line for line in f.read().splitlines() if not line.strip().startswith("#")]
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--api-key-file '{key_file}' cannot be read ({exc}); check the path") from None
        if not any(k.strip() for k in keys):
            raise ConfigError(f"--api-key-file '{key_file}' holds no key; put one key per line")
    return tuple(dict.fromkeys(k.strip() for k in keys if k.strip()))


class QueuePolicy(enum.Enum):
    """How queued requests are ordered (after their priority)."""

    FCFS = "fcfs"
    SJF = "sjf"
    DEADLINE = "deadline"


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """`--router-queue-size`, `--router-queue-timeout`, `--router-queue-policy`."""

    max_size: int = 256
    """Requests that may wait per model; 0 = no queue (every worker busy is an immediate 503)."""
    max_wait_s: float = 0.5
    """The longest a request waits for a worker before its 503; one whose expected wait is longer is
    refused at once (router/queue.py). Set it to what the deployment's TTFT target leaves."""
    policy: QueuePolicy = QueuePolicy.FCFS


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    """The OpenAI HTTP frontend."""

    host: str = "127.0.0.1"
    port: int = 8000
    namespace: str = DEFAULT_NAMESPACE
    router: str = "round-robin"
    """`round-robin`, `random`, `kv` or `remote` (spread over `dyn router` replicas)."""
    http_server: str = "uvicorn"
    """`uvicorn` (httptools + uvloop, the fast default) or `hypercorn` (HTTP/2)."""
    migration_limit: int = 3
    """Re-dispatches of a stream whose worker died; 0 disables migration."""
    max_body_bytes: int = 45 * 1024 * 1024
    max_inflight_per_worker: int = 0
    """A worker with this many streams open from this frontend is busy; 0 = no limit."""
    active_blocks_threshold: float = 1.0
    """A worker whose published KV usage is above this fraction is busy; 1.0 = off."""
    kv_router: KvRouterConfig = field(default_factory=KvRouterConfig)
    """Settings of `--router kv`, and of the `dyn router` replicas `dyn serve --router remote` starts."""
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    """The wait queue for requests that find every worker busy (router/queue.py)."""
    planes: PlanesConfig = field(default_factory=PlanesConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    graceful_shutdown_s: float = 30.0
    """On SIGTERM, seconds the HTTP server waits for the responses in flight to end before it cuts them
    (Kubernetes' default grace period); idle connections are closed at once."""
    tool_call_parser: str = "auto"
    """How model text becomes `tool_calls` (frontend/tools/parsers.py); auto: per model, from its chat template."""
    reasoning_parser: str | None = None
    """How `<think>` text becomes `reasoning_content` (frontend/tools/reasoning.py); None: left in the content."""

    @property
    def scheme(self) -> str:
        """`https` with TLS on, else `http`."""
        return "https" if self.tls.is_enabled else "http"


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """`dyn serve`: a frontend plus worker subprocesses."""

    frontend: FrontendConfig
    worker: WorkerConfig
    num_workers: int = 1
    num_routers: int = 0
    """`dyn router` replicas to spawn (with `--router remote`); the frontend then waits for them."""
    ready_timeout_s: float = 120.0
    """How long to wait for every worker to register before giving up."""
    max_restarts: int = 5
    """Restarts of one worker slot allowed within 5 minutes after it exits unexpectedly (0: never)."""
    num_prefill_workers: int = 0
    """`--disagg`: prefill-role workers started beside the `num_workers` (then decode-role) workers."""
