"""One frozen dataclass per role. Precedence: flag > DYN_* environment (Typer reads it) > default."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from dynamo_cli.engine import Role
from dynamo_cli.errors import ConfigError
from dynamo_cli.model_card import ModelCard

DEFAULT_NAMESPACE = "dynamo"
DEFAULT_MODEL = "smollm2"
DEFAULT_ENGINE = "mocker"
CLUSTER_SECRET_ENV = "DYN_CLUSTER_SECRET"
"""The cluster secret as hex: read by every command, set by `dyn serve` for the processes it starts."""


@dataclass(frozen=True, slots=True)
class KvRouterConfig:
    """Settings of the KV-aware router (flags `--block-size`, `--kv-overlap-score-weight` ...).

    The one place of each router default: the CLI flags, `dyn serve`'s `dyn router` command line and
    the frontend's and router's policies all read them from here.
    """

    block_size: int | None = None
    """Tokens per KV block; must equal the workers' block size. None = the one on the workers' card."""
    overlap_score_weight: float = 1.0
    """w in `w * prefill_blocks + decode_blocks`; 0 = pure load balancing."""
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

    def __post_init__(self) -> None:
        checks = [
            (self.block_size is None or self.block_size > 0, "block_size", self.block_size, "use the workers' one"),
            (self.overlap_score_weight >= 0, "overlap_score_weight", self.overlap_score_weight, "use >= 0"),
            (self.temperature >= 0, "temperature", self.temperature, "use 0 (argmin) or a positive value"),
            (self.hot_spot_min_blocks >= 1, "hot_spot_min_blocks", self.hot_spot_min_blocks, "use >= 1"),
            (0 <= self.hot_spot_ratio <= 1, "hot_spot_ratio", self.hot_spot_ratio, "use a value in [0, 1]"),
            (self.approx_ttl_s > 0, "approx_ttl_s", self.approx_ttl_s, "use a positive number of seconds"),
            (self.approx_max_blocks > 0, "approx_max_blocks", self.approx_max_blocks, "use >= 1"),
        ]
        for ok, name, value, fix in checks:
            if not ok:
                raise ConfigError(f"router {name} ({value}) is invalid; {fix}")

    def for_card(self, card: ModelCard) -> KvRouterConfig:
        """This config with the card's block size, unless a block size was set."""
        return self if self.block_size is not None else replace(self, block_size=card.kv_cache_block_size)


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
    planes: PlanesConfig = field(default_factory=PlanesConfig)


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
