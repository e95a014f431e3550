"""One frozen dataclass per role, each setting declared once on its field (flag, `DYN_*` twin, help, default).

Precedence: flag > DYN_* environment (the CLI reads it) > default. The CLI builds every command's options from
these fields (cli/settings.py); a process `dyn serve` starts gets its config as one JSON document in its
environment (`child_command`, `config_document`), never as a rebuilt command line.

    common.py     defaults, the settings several configs share, PlanesConfig
    routing.py    KvRouterConfig, DisaggConfig, QueueConfig, BusyThresholds (the frontend's and `dyn router`'s)
    frontend.py   FrontendConfig
    security.py   TlsConfig (HTTPS, mutual TLS) and AuthConfig (API keys, per-key limits)
    batch.py      BatchConfig (the Batch API's store and limits)
    lora.py       LoraConfig (a worker's adapters) and the adapter name rule
    telemetry.py  TelemetryConfig: system server port, OTLP traces, log format (every process)
    group.py      GroupConfig: the nodes one engine spans (a worker's leader or follower part)
    processes.py  WorkerConfig, RouterConfig, ServeConfig, and the child processes' config documents
"""

from dynamo_cli.config.batch import BatchConfig
from dynamo_cli.config.common import (
    BLOCK_SIZE,
    CLUSTER_SECRET_ENV,
    DEFAULT_ENGINE,
    DEFAULT_MODEL,
    DEFAULT_NAMESPACE,
    GRACEFUL_SHUTDOWN,
    NAMESPACE,
    PlanesConfig,
)
from dynamo_cli.config.frontend import ROUTER_MODES, FrontendConfig
from dynamo_cli.config.group import GroupConfig
from dynamo_cli.config.lora import LoraConfig
from dynamo_cli.config.processes import (
    CONFIG_DOCUMENTS,
    KV_TRANSFERS,
    ChildCommand,
    RouterConfig,
    ServeConfig,
    WorkerConfig,
    backend_options,
    child_command,
    config_document,
    parse_role,
)
from dynamo_cli.config.routing import (
    DISAGG_POLICIES,
    KV_BYTES_PER_TOKEN,
    ROUTER_COSTS,
    TIER_DISK_GBS,
    TIER_DISK_LATENCY_S,
    TIER_HOST_GBS,
    TIER_HOST_LATENCY_S,
    BusyThresholds,
    DisaggConfig,
    HealthChecks,
    KvRouterConfig,
    QueueConfig,
    QueuePolicy,
    SessionConfig,
    parse_queue_policy,
    parse_tier_weights,
)
from dynamo_cli.config.security import ApiKeys, AuthConfig, TlsConfig, read_api_keys
from dynamo_cli.config.telemetry import LOG_FORMATS, TelemetryConfig
from dynamo_cli.config.tenants import PriorityClass, TenantConfig, TenantSpec

__all__ = [
    "ApiKeys",
    "PriorityClass",
    "TenantConfig",
    "TenantSpec",
    "HealthChecks",
    "GroupConfig",
    "LOG_FORMATS",
    "TelemetryConfig",
    "BLOCK_SIZE",
    "CLUSTER_SECRET_ENV",
    "CONFIG_DOCUMENTS",
    "DEFAULT_ENGINE",
    "DEFAULT_MODEL",
    "DEFAULT_NAMESPACE",
    "DISAGG_POLICIES",
    "GRACEFUL_SHUTDOWN",
    "KV_BYTES_PER_TOKEN",
    "KV_TRANSFERS",
    "NAMESPACE",
    "ROUTER_COSTS",
    "ROUTER_MODES",
    "TIER_DISK_GBS",
    "TIER_DISK_LATENCY_S",
    "TIER_HOST_GBS",
    "TIER_HOST_LATENCY_S",
    "AuthConfig",
    "BatchConfig",
    "BusyThresholds",
    "ChildCommand",
    "DisaggConfig",
    "SessionConfig",
    "FrontendConfig",
    "KvRouterConfig",
    "LoraConfig",
    "PlanesConfig",
    "QueueConfig",
    "QueuePolicy",
    "RouterConfig",
    "ServeConfig",
    "TlsConfig",
    "WorkerConfig",
    "backend_options",
    "child_command",
    "config_document",
    "parse_queue_policy",
    "parse_role",
    "parse_tier_weights",
    "read_api_keys",
]
