"""One frozen dataclass per role. Precedence: flag > DYN_* environment (Typer reads it) > default."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dynamo_cli.engine import Role
from dynamo_cli.router.kv import KvRouterConfig

DEFAULT_NAMESPACE = "dynamo"
DEFAULT_MODEL = "smollm2"
DEFAULT_ENGINE = "mocker"


@dataclass(frozen=True, slots=True)
class PlanesConfig:
    """Where the discovery and event planes are."""

    discovery: str = "embedded"
    """`embedded`, `file:///DIR` or `etcd://HOST:PORT[,HOST:PORT]`."""
    events: str = "embedded"
    """`embedded` (ZMQ advertised via discovery) or `nats://HOST:PORT`."""
    lease_ttl: float = 10.0
    """Seconds before a dead process's keys vanish."""


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
