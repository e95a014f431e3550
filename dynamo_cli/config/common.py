"""What several configs share: defaults, the settings held by more than one (one option each, its value to every
config holding it), and where the planes are."""

from __future__ import annotations

from dataclasses import dataclass, field

from dynamo_cli.errors import ConfigError
from dynamo_cli.settings import ENGINE, PLANES, SUPERVISION, Setting, setting

DEFAULT_NAMESPACE = "dynamo"
DEFAULT_MODEL = "smollm2"
DEFAULT_ENGINE = "llamacpp"
"""The built-in real model on CPU: what `dyn serve` and `dyn worker` run unless told otherwise."""
CLUSTER_SECRET_ENV = "DYN_CLUSTER_SECRET"
"""The cluster secret as hex: read by every command, set by `dyn serve` for the processes it starts."""


NAMESPACE = Setting(("--namespace",), "DYN_NAMESPACE", "Deployment namespace.", PLANES)
BLOCK_SIZE = Setting(("--block-size",), "DYN_KV_CACHE_BLOCK_SIZE", "KV block size in tokens.", ENGINE)
GRACEFUL_SHUTDOWN = Setting(
    ("--graceful-shutdown",),
    "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS",
    "On SIGTERM: seconds to finish the streams in flight after deregistering.",
    SUPERVISION,
)


@dataclass(frozen=True, slots=True)
class PlanesConfig:
    """Where the discovery and event planes are."""

    discovery: str = setting("embedded", "--discovery", env="DYN_DISCOVERY", panel=PLANES)
    """The discovery plane: embedded | file:///DIR | etcd://HOST:PORT[,HOST:PORT]."""
    events: str = setting("embedded", "--events", env="DYN_EVENTS", panel=PLANES)
    """The event plane: embedded (ZMQ, advertised via discovery) | nats://HOST:PORT."""
    lease_ttl: float = setting(10.0, "--lease-ttl", env="DYN_LEASE_TTL", panel=PLANES)
    """Discovery lease TTL: seconds before a dead process's keys vanish."""
    start_wait_s: float = setting(0.0, "--planes-wait", env="DYN_PLANES_WAIT", panel=PLANES)
    """Seconds to keep trying the planes at start while they are unreachable (etcd or NATS not up yet) before
    failing; 0: fail at once. `dyn k8s render` sets it to the workers' start-up allowance."""
    cluster_secret: bytes | None = field(default=None, repr=False)
    """The request plane's shared secret (`--cluster-secret-file`, DYN_CLUSTER_SECRET; `dyn serve` makes
    one); every connection authenticates with it. None = unauthenticated, allowed on loopback only."""

    def __post_init__(self) -> None:
        if self.lease_ttl <= 0:
            raise ConfigError(f"--lease-ttl must be positive, got {self.lease_ttl}")
        if self.start_wait_s < 0:
            raise ConfigError(f"--planes-wait must be >= 0, got {self.start_wait_s}")
