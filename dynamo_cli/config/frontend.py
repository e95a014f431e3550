"""The OpenAI HTTP frontend's settings: address, routing mode, API keys, TLS, limits and parsers."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dynamo_cli.config.common import DEFAULT_NAMESPACE, NAMESPACE, PlanesConfig
from dynamo_cli.config.routing import BusyThresholds, DisaggConfig, HealthChecks, KvRouterConfig, QueueConfig
from dynamo_cli.config.telemetry import TelemetryConfig
from dynamo_cli.errors import ConfigError
from dynamo_cli.settings import BATCH, HTTP, OVERLOAD, ROUTING, SECURITY, setting


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """HTTPS on the frontend (`--tls-cert-file`, `--tls-key-file`), mutual TLS with `--tls-ca-file`."""

    cert_file: str | None = setting(
        None, "--tls-cert-file", env="DYN_TLS_CERT_FILE", help="PEM certificate: serve HTTPS.", panel=SECURITY
    )
    """PEM certificate chain the frontend presents; None = plain HTTP."""
    key_file: str | None = setting(
        None, "--tls-key-file", env="DYN_TLS_KEY_FILE", help="PEM private key of the cert.", panel=SECURITY
    )
    """PEM private key of `cert_file`."""
    ca_file: str | None = setting(
        None,
        "--tls-ca-file",
        env="DYN_TLS_CA_FILE",
        help="PEM CA: require client certificates (mTLS).",
        panel=SECURITY,
    )
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
    rps: float = setting(
        0.0, "--api-key-rps", env="DYN_API_KEY_RPS", help="Requests/s per key (0: no limit).", panel=SECURITY
    )
    """Requests per second per key (token bucket, burst = max(1, rps)); 0 = no limit."""
    max_inflight: int = setting(
        0,
        "--api-key-max-inflight",
        env="DYN_API_KEY_MAX_INFLIGHT",
        help="Requests in flight per key (0: no limit).",
        panel=SECURITY,
    )
    """Requests open at once per key; 0 = no limit."""
    metrics_require_key: bool = setting(
        False, "--metrics-require-key", env="DYN_METRICS_REQUIRE_KEY", help="/metrics needs a key.", panel=SECURITY
    )
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


def is_postgres(db: str) -> bool:
    """Whether `--batch-db` names a PostgreSQL database (a URL) rather than a SQLite file."""
    return db.startswith(("postgresql://", "postgres://"))


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """OpenAI's Batch API on the frontend: where batches are kept and how much of the workers they may take."""

    db: str = setting(
        "",
        "--batch-db",
        env="DYN_BATCH_DB",
        help="Where batches are kept: a SQLite file (default: $DYN_STATE_DIR/NAMESPACE/batches.db), a"
        " postgresql:// URL shared by several frontends (password from PGPASSWORD), or off (no batch API).",
        panel=BATCH,
    )
    """The database: a SQLite file's path ("" = `batches.db` in the namespace's state directory, `$DYN_STATE_DIR`,
    default ~/.local/state/dyn: the frontends of one `dyn serve` share it); a `postgresql://` URL (frontends on
    several hosts share it; the password comes from libpq's PGPASSWORD, never the command line); "off" = no
    /v1/files, no /v1/batches."""
    max_inflight: int = setting(
        0,
        "--batch-max-inflight",
        env="DYN_BATCH_MAX_INFLIGHT",
        help="Batch requests in flight at once (0: half the requests the workers run before they count as busy).",
        panel=BATCH,
    )
    """The most batch lines running at once across the deployment's workers; 0 = half of what the workers
    serving a batch's model run before they count as busy (so interactive requests find room)."""
    max_file_bytes: int = setting(
        200 * 1024 * 1024,
        "--batch-max-file-mb",
        env="DYN_BATCH_MAX_FILE_MB",
        help="Largest batch input file (MiB).",
        panel=BATCH,
        cli_type=float,
        parse=lambda mb: int(mb * 1024 * 1024),
        show=lambda nbytes: nbytes / 1024 / 1024,
    )
    max_lines: int = setting(
        50_000, "--batch-max-lines", env="DYN_BATCH_MAX_LINES", help="Most lines in a batch input file.", panel=BATCH
    )

    def __post_init__(self) -> None:
        if self.max_inflight < 0 or self.max_file_bytes <= 0 or self.max_lines <= 0:
            raise ConfigError(
                f"--batch-max-inflight must be >= 0 ({self.max_inflight}), --batch-max-file-mb and --batch-max-lines"
                f" > 0 ({self.max_file_bytes / 1024 / 1024:g}, {self.max_lines})"
            )

    @property
    def is_enabled(self) -> bool:
        return self.db != "off"

    def where(self, namespace: str) -> str:
        """The database of `namespace`'s batches: a URL, or a SQLite file's path."""
        if is_postgres(self.db):
            return self.db
        if self.db:
            return str(Path(self.db).expanduser())
        state = os.environ.get("DYN_STATE_DIR") or str(Path.home() / ".local" / "state" / "dyn")
        return str(Path(state) / namespace / "batches.db")


ROUTER_MODES = ("round-robin", "random", "kv", "remote")
"""`--router`: how the frontend picks a worker (`remote`: `dyn router` replicas pick)."""


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    """The OpenAI HTTP frontend."""

    host: str = setting("127.0.0.1", "--host", env="DYN_HTTP_HOST", help="HTTP address.")
    port: int = setting(8000, "--port", "-p", env="DYN_HTTP_PORT", help="HTTP port (0: any free port).")
    namespace: str = setting(DEFAULT_NAMESPACE, NAMESPACE)
    router: str = setting(
        "round-robin", "--router", env="DYN_ROUTER_MODE", help="round-robin | random | kv | remote (dyn routers)"
    )
    """`round-robin`, `random`, `kv` or `remote` (spread over `dyn router` replicas)."""
    http_server: str = setting(
        "uvicorn", "--http-server", env="DYN_HTTP_SERVER", help="uvicorn | hypercorn", panel=HTTP
    )
    """`uvicorn` (httptools + uvloop, the fast default) or `hypercorn` (HTTP/2)."""
    migration_limit: int = setting(
        3,
        "--migration-limit",
        env="DYN_MIGRATION_LIMIT",
        help="Re-dispatches of a stream whose worker died (0: none).",
        panel=OVERLOAD,
    )
    """Re-dispatches of a stream whose worker died; 0 disables migration."""
    max_body_bytes: int = setting(
        45 * 1024 * 1024,
        "--body-limit-mb",
        env="DYN_HTTP_BODY_LIMIT_MB",
        help="Largest request body (MiB).",
        panel=HTTP,
        cli_type=float,
        parse=lambda mb: int(mb * 1024 * 1024),
        show=lambda nbytes: nbytes / 1024 / 1024,
    )
    busy: BusyThresholds = field(default_factory=BusyThresholds)
    """When a worker counts as busy (behind `dyn router`s: theirs, not the frontend's)."""
    health: HealthChecks = field(default_factory=HealthChecks)
    """How hung workers are found and let back in (behind `dyn router`s: the routers do it)."""
    kv_router: KvRouterConfig = field(default_factory=KvRouterConfig)
    """Settings of `--router kv`, and of the `dyn router` replicas `dyn serve --router remote` starts."""
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    """The wait queue for requests that find every worker busy (core/queue.py)."""
    planes: PlanesConfig = field(default_factory=PlanesConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    """OpenAI's Batch API (`/v1/files`, `/v1/batches`): its database and limits."""
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    """Traces and logs (its system port is the workers' base in `dyn serve`: the frontend serves its own probes)."""
    graceful_shutdown_s: float = 30.0
    """On SIGTERM, seconds the HTTP server waits for the responses in flight to end before it cuts them
    (Kubernetes' default grace period); idle connections are closed at once."""
    tool_call_parser: str = setting(
        "auto",
        "--tool-call-parser",
        env="DYN_TOOL_CALL_PARSER",
        help="auto | hermes | llama3_json | mistral | pythonic | json: model text → tool_calls.",
        panel=HTTP,
    )
    """How model text becomes `tool_calls` (frontend/tools/parsers.py); auto: per model, from its chat template."""
    reasoning_parser: str | None = setting(
        None,
        "--reasoning-parser",
        env="DYN_REASONING_PARSER",
        help="basic | qwen3 | deepseek_r1: <think> text → reasoning_content (default: none).",
        panel=HTTP,
    )
    """How `<think>` text becomes `reasoning_content` (frontend/tools/reasoning.py); None: left in the content."""
    replica_sync: bool = setting(
        False,
        "--router-replica-sync/--no-router-replica-sync",
        env="DYN_ROUTER_REPLICA_SYNC",
        help="KV router: share in-flight load with the other frontends and dyn routers (on with --frontends > 1).",
        panel=ROUTING,
    )
    """Publish this frontend's routing decisions and count its peers' (core/replicas.py), as `dyn router`
    replicas do: several frontends in front of the same workers then see one in-flight load."""
    lora_replicas: int = setting(
        0,
        "--lora-replicas",
        env="DYN_LORA_REPLICAS",
        help="POST /v1/load_lora_adapter loads on this many of the base's workers, least loaded first (0: all).",
        panel=ROUTING,
    )
    """Workers a run-time adapter load goes to (the least loaded of the base model's); 0: every one."""
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
    def scheme(self) -> str:
        """`https` with TLS on, else `http`."""
        return "https" if self.tls.is_enabled else "http"
