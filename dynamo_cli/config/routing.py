"""The routers' settings: the KV router's cost, disaggregation's rule, the wait queue and the busy thresholds.

The frontend's router and every `dyn router` replica hold the same four configs; `dyn serve --routers N`
hands its own to each replica it starts (`ServeConfig.router_config`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from dynamo_cli.config.common import BLOCK_SIZE
from dynamo_cli.errors import ConfigError
from dynamo_cli.model_card import ModelCard
from dynamo_cli.settings import DISAGG, IN_KIB, OVERLOAD, ROUTING, setting

ROUTER_COSTS = ("time", "dynamo")
"""`--router-cost`: the KV router's cost function."""
KV_BYTES_PER_TOKEN = 131_072
"""KV bytes per token when the card does not say (Llama-3-8B fp16; docs/design/kv-tier-filter.md has the derivation)."""


TIER_HOST_GBS = 20.0
"""GB/s of a KV onboard from host memory: pinned copies over PCIe 4.0 x16 (~25 peak, 20 sustained). One
figure for the router's cost (routing/tier_costs.py) and the mocker's timing model, so they agree by default."""
TIER_DISK_GBS = 4.0
"""GB/s of a KV onboard from local disk: one NVMe Gen4 SSD's sequential read (3-7 GB/s)."""
TIER_HOST_LATENCY_S = 20e-6
"""Fixed cost of one host -> device transfer (a copy's launch and synchronisation)."""
TIER_DISK_LATENCY_S = 200e-6
"""Fixed cost of one disk -> device transfer (an NVMe read's queueing and completion, plus the hop
through host memory)."""


def parse_tier_weights(text: str) -> tuple[tuple[str, float], ...]:
    """`host=0.8,disk=0.3` -> (("host", 0.8), ("disk", 0.3)); an empty string -> () (derived weights)."""
    pairs: list[tuple[str, float]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if name.strip() not in ("host", "disk") or not 0 <= weight <= 1:
            raise ConfigError(f"--router-tier-weights item '{item}' is invalid; use host=W,disk=W with W in [0, 1]")
        pairs.append((name.strip(), weight))
    return tuple(pairs)


def _show_tier_weights(weights: tuple[tuple[str, float], ...]) -> str:
    return ",".join(f"{tier}={weight}" for tier, weight in weights)


@dataclass(frozen=True, slots=True)
class KvRouterConfig:
    """Settings of the KV-aware router: the frontend's `--router kv` and every `dyn router`."""

    block_size: int | None = setting(None, BLOCK_SIZE)
    """Tokens per KV block; must equal the workers' block size. None = the one on the workers' card."""
    cost: str = setting(
        "time",
        "--router-cost",
        env="DYN_ROUTER_COST",
        panel=ROUTING,
    )
    """KV router cost: time (seconds of prefill, evictions and KV wait) | dynamo (Dynamo's
    w * prefill_blocks + decode_blocks).

    The `time` cost is routing/time_cost.py."""
    overlap_score_weight: float = setting(
        1.0,
        "--kv-overlap-score-weight",
        env="DYN_KV_OVERLAP_SCORE_WEIGHT",
        panel=ROUTING,
    )
    """KV router, dynamo cost: weight w of prefill blocks in w * prefill_blocks + decode_blocks (0: pure load
    balancing)."""
    prefill_tokens_per_s: float | None = setting(
        None,
        "--router-prefill-tps",
        env="DYN_ROUTER_PREFILL_TPS",
        panel=ROUTING,
    )
    """KV router, time cost: a worker's prefill tokens/s (default: learned from the first tokens the
    router sees)."""
    total_kv_blocks: int | None = None
    """`time` cost: a worker's KV capacity until it publishes its own; None = the card's."""
    temperature: float = setting(
        0.0,
        "--router-temperature",
        env="DYN_ROUTER_TEMPERATURE",
        panel=ROUTING,
    )
    """KV router: 0 = argmin, > 0 = softmax sampling over normalised logits."""
    use_kv_events: bool = setting(
        True,
        "--kv-events/--no-kv-events",
        env="DYN_KV_EVENTS",
        panel=ROUTING,
    )
    """KV router: use the workers' KV events; off = approximate mode, from the router's own decisions."""
    image_hashes: bool = setting(
        True,
        "--router-image-hashes/--no-router-image-hashes",
        env="DYN_ROUTER_IMAGE_HASHES",
        panel=ROUTING,
    )
    """KV router: hash each image's content into the prompt it routes (kv/images.py); off = image-blind, the
    placeholders hashed as text (what a router that ignores images sees: benchmarks/multimodal.py)."""
    hot_spot_guard: bool = setting(
        True,
        "--hot-spot-guard/--no-hot-spot-guard",
        env="DYN_HOT_SPOT_GUARD",
        panel=ROUTING,
    )
    """KV router: ignore the cache and pick by load when active blocks are badly imbalanced.

    Badly: max - min active blocks >= `hot_spot_min_blocks` and >= `hot_spot_ratio` * max (routing/cost.py)."""
    hot_spot_min_blocks: int = 512
    """Hot-spot absolute threshold: max - min active blocks."""
    hot_spot_ratio: float = 0.5
    """Hot-spot relative threshold: (max - min) / max active blocks."""
    approx_ttl_s: float = setting(
        120.0,
        "--router-ttl",
        env="DYN_ROUTER_TTL_SECS",
        panel=ROUTING,
    )
    """KV router, approximate mode (`--no-kv-events`): seconds a routed prefix counts as cached."""
    approx_max_blocks: int = 1 << 20
    """Approximate mode: entries kept before pruning to 80 %."""
    host_bandwidth_gbs: float = setting(
        TIER_HOST_GBS,
        "--router-host-bandwidth-gbs",
        env="DYN_ROUTER_HOST_BANDWIDTH_GBS",
        panel=ROUTING,
    )
    """KV router: GB/s of an onboard from the host-memory tier (default: PCIe 4.0 x16 pinned copies).

    Used by routing/tier_costs.py."""
    disk_bandwidth_gbs: float = setting(
        TIER_DISK_GBS,
        "--router-disk-bandwidth-gbs",
        env="DYN_ROUTER_DISK_BANDWIDTH_GBS",
        panel=ROUTING,
    )
    """KV router: GB/s of an onboard from the disk tier (default: one NVMe Gen4 SSD).

    Used by routing/tier_costs.py."""
    tier_weights: tuple[tuple[str, float], ...] = setting(
        (),
        "--router-tier-weights",
        env="DYN_ROUTER_TIER_WEIGHTS",
        panel=ROUTING,
        cli_type=str,
        parse=parse_tier_weights,
        show=_show_tier_weights,
    )
    """KV router, dynamo cost: worth of a host or disk hit vs a device hit, host=W,disk=W with W in
    [0, 1] (default: from the bandwidths)."""
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
        """This config with the card's block size, KV capacity (one rank's: a target's) and KV bytes per block,
        unless they were set."""
        block_size = self.block_size if self.block_size is not None else card.kv_cache_block_size
        total = self.total_kv_blocks if self.total_kv_blocks is not None else card.total_kv_blocks // card.dp_size
        nbytes = self.kv_bytes_per_block or card.kv_bytes_per_block or KV_BYTES_PER_TOKEN * block_size
        return replace(self, block_size=block_size, total_kv_blocks=total, kv_bytes_per_block=nbytes)


DISAGG_POLICIES = ("adaptive", "always", "isl", "load", "isl-or-load")


SESSION_MODES = ("soft", "hard")


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """Session affinity (`x-dyn-session-id`): a session's calls to the worker of its last call (routing/sessions.py)."""

    ttl_s: float = setting(600.0, "--router-session-affinity-ttl", env="DYN_ROUTER_SESSION_AFFINITY_TTL", panel=ROUTING)
    """Seconds a session stays bound to the worker of its last call (0: no affinity; at most a year)."""
    mode: str = setting("soft", "--router-session-affinity-mode", env="DYN_ROUTER_SESSION_AFFINITY_MODE", panel=ROUTING)
    """soft: the bound worker unless it is busy or another has more of the prompt cached | hard: always it."""
    max_entries: int = setting(
        65_536, "--router-session-table-size", env="DYN_ROUTER_SESSION_TABLE_SIZE", panel=ROUTING
    )
    """Sessions remembered per model, least recently used forgotten first."""

    def __post_init__(self) -> None:
        if self.mode not in SESSION_MODES:
            raise ConfigError(f"--router-session-affinity-mode must be soft or hard, got {self.mode!r}")
        if not 0 <= self.ttl_s <= 31_536_000 or not 1 <= self.max_entries <= 1_000_000:
            raise ConfigError(
                "--router-session-affinity-ttl must be 0 to 31536000 s and --router-session-table-size 1 to 1000000"
            )


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """When a request's prompt is prefilled on a prefill worker rather than on its decode worker
    (core/disagg.py has the rules). Applies to a model that has prefill workers."""

    policy: str = setting(
        "adaptive",
        "--disagg-policy",
        env="DYN_DISAGG_POLICY",
        panel=DISAGG,
    )
    """When a prompt is prefilled on a prefill worker: adaptive (weighs both pools' queued prefill work)
    | always | isl | load | isl-or-load (Dynamo's isl_bounding, prefill_load, isl_or_load)."""
    max_local_prefill_length: int = setting(
        512,
        "--max-local-prefill-length",
        env="DYN_MAX_LOCAL_PREFILL_LENGTH",
        panel=DISAGG,
    )
    """Uncached prompt tokens (effective ISL) at or below which a decode worker prefills a prompt itself."""
    max_prefill_queue: int = setting(
        4,
        "--max-prefill-queue",
        env="DYN_MAX_PREFILL_QUEUE",
        panel=DISAGG,
    )
    """Policies load, isl-or-load: prefills queued on a prefill worker when it counts saturated;
    all saturated → prefill locally."""
    decode_busy_threshold: float = setting(
        0.9,
        "--decode-busy-threshold",
        env="DYN_DECODE_BUSY_THRESHOLD",
        panel=DISAGG,
    )
    """KV usage fraction of a decode worker at or above which long prompts always go to a prefill worker,
    whatever the policy.

    A circuit breaker (core/disagg.py)."""
    enforce: bool = setting(
        False,
        "--enforce-disagg",
        env="DYN_ENFORCE_DISAGG",
        panel=DISAGG,
    )
    """Never prefill on a decode worker: no prefill worker → 503 naming the pool, never an aggregated fallback."""
    first_token: str = setting("early", "--disagg-first-token", env="DYN_DISAGG_FIRST_TOKEN", panel=DISAGG)
    """A remote prefill's first token: early (sent when the prefill worker has it) | with-decode (held, and sent
    with the decode worker's first: the hand-over then lands in the time to first token, not between the first
    two tokens, as Dynamo does)."""
    prefill_router_mode: str | None = setting(
        None,
        "--prefill-router-mode",
        env="DYN_PREFILL_ROUTER_MODE",
        panel=DISAGG,
    )
    """Routing of the prefill hop: kv | round-robin | random (default: the frontend's `--router`)."""
    encode_min_bytes: int = setting(16 * 1024, "--encode-min-kb", env="DYN_ENCODE_MIN_KB", panel=DISAGG, **IN_KIB)
    """E/P/D: images at least this big (KiB) go to an encode worker; smaller ones cost the serving worker's own
    encoder less than the hop (0: every image)."""
    encode_max_inflight: int = setting(16, "--encode-max-inflight", env="DYN_ENCODE_MAX_INFLIGHT", panel=DISAGG)
    """E/P/D: encode calls in flight on one encode worker before its images go to the next one."""
    encode_timeout_s: float = setting(10.0, "--encode-timeout", env="DYN_ENCODE_TIMEOUT", panel=DISAGG)
    """E/P/D: seconds an encode call may take; a late one leaves its images to the serving worker's encoder."""

    def __post_init__(self) -> None:
        if self.encode_min_bytes < 0 or self.encode_max_inflight < 1 or self.encode_timeout_s <= 0:
            raise ConfigError("--encode-min-kb must be >= 0, --encode-max-inflight >= 1, --encode-timeout > 0")
        if self.first_token not in ("early", "with-decode"):
            raise ConfigError(f"--disagg-first-token '{self.first_token}' is unknown; use early or with-decode")
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


class QueuePolicy(enum.Enum):
    """How queued requests are ordered (after their priority)."""

    FCFS = "fcfs"
    SJF = "sjf"
    DEADLINE = "deadline"


def parse_queue_policy(value: str) -> QueuePolicy:
    """`--router-queue-policy`'s text as a QueuePolicy, or ConfigError naming the choices."""
    try:
        return QueuePolicy(value)
    except ValueError:
        choices = " | ".join(p.value for p in QueuePolicy)
        raise ConfigError(f"--router-queue-policy '{value}' is not one of {choices}") from None


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """The wait queue of requests that find every worker busy (core/queue.py)."""

    max_size: int = setting(
        256,
        "--router-queue-size",
        env="DYN_ROUTER_QUEUE_SIZE",
        panel=OVERLOAD,
    )
    """Requests that may wait per model when every worker is busy (0: no queue, an immediate 503)."""
    max_wait_s: float = setting(
        0.5,
        "--router-queue-timeout",
        env="DYN_ROUTER_QUEUE_TIMEOUT",
        panel=OVERLOAD,
    )
    """Seconds a request waits for a worker before its 503; one whose expected wait is longer gets it at
    once. Set it to what the deployment's TTFT target leaves.

    The expected wait is core/queue.py's `expected_wait`."""
    policy: QueuePolicy = setting(
        QueuePolicy.FCFS,
        "--router-queue-policy",
        env="DYN_ROUTER_QUEUE_POLICY",
        panel=OVERLOAD,
        cli_type=str,
        parse=parse_queue_policy,
        show=lambda policy: policy.value,
    )
    """Order of waiting requests, after x-dyn-priority: fcfs | sjf | deadline."""
    fair_share: bool = setting(
        True, "--tenant-fair-share/--no-tenant-fair-share", env="DYN_TENANT_FAIR_SHARE", panel=OVERLOAD
    )
    """Within a priority class, the queue serves the tenant that has had the least work (tokens, by its weight)
    first; off: one queue for all tenants."""
    output_token_weight: float = setting(
        2.0, "--tenant-output-token-weight", env="DYN_TENANT_OUTPUT_WEIGHT", panel=OVERLOAD
    )
    """The work of an output token in prompt tokens (uncached prompt tokens count 1 each), for the fair share."""
    preemption: bool = setting(
        True, "--priority-preemption/--no-priority-preemption", env="DYN_PRIORITY_PREEMPTION", panel=OVERLOAD
    )
    """A waiting interactive (or system) request may pause a running bulk one, which resumes, with nothing lost,
    once the queue lets it."""

    def __post_init__(self) -> None:
        if self.max_size < 0 or not self.max_wait_s > 0:
            raise ConfigError(
                f"--router-queue-size must be >= 0 ({self.max_size}) and --router-queue-timeout > 0 ({self.max_wait_s})"
            )
        if not 0.0 <= self.output_token_weight <= 100.0:
            raise ConfigError(f"--tenant-output-token-weight must be in 0..100, got {self.output_token_weight:g}")


@dataclass(frozen=True, slots=True)
class BusyThresholds:
    """When a worker counts as busy: every worker busy sends a request to the wait queue, then a 503."""

    max_inflight: int = setting(
        0,
        "--max-inflight-per-worker",
        env="DYN_MAX_INFLIGHT_PER_WORKER",
        panel=OVERLOAD,
    )
    """Busy threshold: streams in flight from this process to one worker (0: no limit); all workers
    busy → the wait queue, then 503."""
    active_blocks_fraction: float = setting(
        1.0,
        "--active-decode-blocks-threshold",
        env="DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD",
        panel=OVERLOAD,
    )
    """Busy threshold: KV usage fraction (published active / total blocks) above which a worker is busy
    (>= 1.0: off)."""


@dataclass(frozen=True, slots=True)
class HealthChecks:
    """How a router (the frontend's, or `dyn router`) finds a hung worker, takes it out of routing and lets it
    back in (core/health.py): a per-stream inter-token deadline while streams are open, and canary requests."""

    stall_timeout_s: float = setting(
        10.0,
        "--stall-timeout",
        env="DYN_STALL_TIMEOUT",
        panel=OVERLOAD,
    )
    """Seconds a stream may wait for its worker while the worker sends nothing at all (no output on any stream,
    no load report): then the worker counts as hung, leaves routing and its streams migrate (0: never)."""
    is_canary_enabled: bool = setting(
        False,
        "--health-check/--no-health-check",
        env="DYN_HEALTH_CHECK_ENABLED",
        panel=OVERLOAD,
    )
    """Send a one-token canary to workers idle for --canary-wait; one that does not answer in time
    is taken out of routing (a hung worker is always probed until it answers again).

    Off by default as in Dynamo (off locally, on under its Kubernetes operator)."""
    canary_wait_s: float = setting(10.0, "--canary-wait", env="DYN_CANARY_WAIT_TIME", panel=OVERLOAD)
    """Idle seconds on a worker (no stream of this process on it) before a canary is sent."""
    check_timeout_s: float = setting(
        3.0,
        "--health-check-timeout",
        env="DYN_HEALTH_CHECK_REQUEST_TIMEOUT",
        panel=OVERLOAD,
    )
    """Seconds a canary may take before the worker counts as hung."""

    def __post_init__(self) -> None:
        if self.stall_timeout_s < 0 or self.canary_wait_s <= 0 or self.check_timeout_s <= 0:
            raise ConfigError(
                f"--stall-timeout {self.stall_timeout_s} / --canary-wait {self.canary_wait_s} / "
                f"--health-check-timeout {self.check_timeout_s}: use seconds >= 0 (stall) and > 0 (the others)"
            )
