"""The OpenAI HTTP frontend's settings: address, routing mode, limits and parsers, with its security (security.py)
and Batch API (batch.py) settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from dynamo_cli.config.batch import BatchConfig
from dynamo_cli.config.common import DEFAULT_NAMESPACE, NAMESPACE, PlanesConfig
from dynamo_cli.config.media import MediaConfig
from dynamo_cli.config.routing import (
    BusyThresholds,
    DisaggConfig,
    HealthChecks,
    KvRouterConfig,
    QueueConfig,
    SessionConfig,
)
from dynamo_cli.config.security import AuthConfig, TlsConfig
from dynamo_cli.config.telemetry import TelemetryConfig
from dynamo_cli.config.tenants import TenantConfig
from dynamo_cli.errors import ConfigError
from dynamo_cli.settings import HTTP, IN_MIB, OVERLOAD, ROUTING, setting

ROUTER_MODES = ("round-robin", "random", "kv", "remote")
"""`--router`: how the frontend picks a worker (`remote`: `dyn router` replicas pick)."""


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    """The OpenAI HTTP frontend."""

    host: str = setting("127.0.0.1", "--host", env="DYN_HTTP_HOST")
    """HTTP address to listen on."""
    port: int = setting(8000, "--port", "-p", env="DYN_HTTP_PORT")
    """HTTP port (0: any free port)."""
    advertise_host: str | None = setting(None, "--advertise-host", env="DYN_HTTP_ADVERTISE_HOST", panel=HTTP)
    """The address a planner reaches this frontend's /metrics at, as registered in discovery (default: --host;
    give it where --host is 0.0.0.0: a pod's IP)."""
    namespace: str = setting(DEFAULT_NAMESPACE, NAMESPACE)
    router: str = setting("round-robin", "--router", env="DYN_ROUTER_MODE")
    """How the frontend picks a worker: round-robin | random | kv | remote (spread over `dyn router` replicas)."""
    kserve_grpc_port: int | None = setting(None, "--kserve-grpc-port", env="DYN_KSERVE_GRPC_PORT", panel=HTTP)
    """Also serve the KServe v2 inference protocol over gRPC on this port (0: any free port; default: off), on
    --host, with the HTTP port's TLS and API keys (frontend/kserve/). Needs grpcio (the `kserve` extra)."""
    http_server: str = setting("uvicorn", "--http-server", env="DYN_HTTP_SERVER", panel=HTTP)
    """HTTP server: uvicorn (httptools + uvloop, the fast default) | hypercorn (HTTP/2)."""
    migration_limit: int = setting(3, "--migration-limit", env="DYN_MIGRATION_LIMIT", panel=OVERLOAD)
    """Re-dispatches of a stream whose worker died (0: no migration)."""
    max_body_bytes: int = setting(
        45 * 1024 * 1024,
        "--body-limit-mb",
        env="DYN_HTTP_BODY_LIMIT_MB",
        panel=HTTP,
        **IN_MIB,
    )
    """Largest request body (MiB)."""
    busy: BusyThresholds = field(default_factory=BusyThresholds)
    """When a worker counts as busy (behind `dyn router`s: theirs, not the frontend's)."""
    health: HealthChecks = field(default_factory=HealthChecks)
    """How hung workers are found and let back in (behind `dyn router`s: the routers do it)."""
    kv_router: KvRouterConfig = field(default_factory=KvRouterConfig)
    """Settings of `--router kv`, and of the `dyn router` replicas `dyn serve --router remote` starts."""
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    sessions: SessionConfig = field(default_factory=SessionConfig)
    """Session affinity (`x-dyn-session-id`; behind `dyn router`s: theirs)."""
    queue: QueueConfig = field(default_factory=QueueConfig)
    """The wait queue for requests that find every worker busy (core/queue.py)."""
    planes: PlanesConfig = field(default_factory=PlanesConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    tenants: TenantConfig = field(default_factory=TenantConfig)
    """Who shares the deployment and what each tenant may use (config/tenants.py)."""
    tls: TlsConfig = field(default_factory=TlsConfig)
    media: MediaConfig = field(default_factory=MediaConfig)
    """Images in requests: where they may come from, how big they may be."""
    batch: BatchConfig = field(default_factory=BatchConfig)
    """OpenAI's Batch API (`/v1/files`, `/v1/batches`): its database and limits."""
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    """Traces and logs (its system port is the workers' base in `dyn serve`: the frontend serves its own probes)."""
    graceful_shutdown_s: float = 30.0
    """On SIGTERM, seconds the HTTP server waits for the responses in flight to end before it cuts them
    (Kubernetes' default grace period); idle connections are closed at once."""
    tool_call_parser: str = setting("auto", "--tool-call-parser", env="DYN_TOOL_CALL_PARSER", panel=HTTP)
    """How model text becomes tool_calls: auto | hermes | llama3_json | mistral | pythonic | json (auto: per
    model, from its chat template).

    The parsers are in frontend/tools/parsers.py."""
    reasoning_parser: str | None = setting(None, "--reasoning-parser", env="DYN_REASONING_PARSER", panel=HTTP)
    """How <think> text becomes reasoning_content: basic | qwen3 | deepseek_r1 (default: none, the text stays in
    the content).

    The parsers are in frontend/tools/reasoning.py."""
    replica_sync: bool = setting(
        False, "--router-replica-sync/--no-router-replica-sync", env="DYN_ROUTER_REPLICA_SYNC", panel=ROUTING
    )
    """KV router: share in-flight load with the other frontends and dyn routers (on with --frontends > 1).

    Publishes this frontend's routing decisions and counts its peers' (core/replicas.py), as `dyn router`
    replicas do: several frontends in front of the same workers then see one in-flight load."""
    lora_replicas: int = setting(0, "--lora-replicas", env="DYN_LORA_REPLICAS", panel=ROUTING)
    """Workers a run-time adapter load (POST /v1/load_lora_adapter) goes to, least loaded of the base model's
    first (0: all)."""
    reuse_port: bool = False
    """Bind the HTTP port with SO_REUSEPORT: the frontends of one `dyn serve --frontends N` share it."""
    metrics_dir: str | None = None
    """Those frontends' shared metrics directory (frontend/metrics_group.py): `/metrics` on any of them shows the
    group's totals. None: this frontend's own registry."""

    def __post_init__(self) -> None:
        if self.migration_limit < 0:
            raise ConfigError(f"--migration-limit must be >= 0, got {self.migration_limit}")
        if self.lora_replicas < 0:
            raise ConfigError(f"--lora-replicas must be >= 0, got {self.lora_replicas}")

    @property
    def advertised_host(self) -> str:
        """Where other processes reach this frontend: `advertise_host`, else `host`."""
        return self.advertise_host or self.host

    @property
    def scheme(self) -> str:
        """`https` with TLS on, else `http`."""
        return "https" if self.tls.is_enabled else "http"
