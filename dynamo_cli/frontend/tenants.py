"""The frontend's tenants (config/tenants.py): who sends a request, what it may still use, and what it used.

    identify  the tenant of a request: its API key's (the gate put the key's index in the scope), else with keys
              off its `x-dyn-tenant` header, else "default"; its class from `x-dyn-priority-class`
    admit     its in-flight limit (429 naming it), held until the response ends
    spend     its tokens a minute: the prompt must be payable now (429 with the seconds until it is), the output
              is paid when it ends (the bucket may go below zero: the next prompt waits for it)

Each limit a tenant hits is a `RateLimited` (429, `retry-after`) that names the limit, counted per tenant. The
table of header-named tenants is bounded (`--tenant-table-size`, least recently seen forgotten, with its series).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.types import Scope

from dynamo_cli.config.tenants import (
    CLASS_HEADER,
    DEFAULT_TENANT,
    TENANT_HEADER,
    TENANT_NAME,
    PriorityClass,
    TenantConfig,
    TenantSpec,
    class_header,
)
from dynamo_cli.core.metrics import LATENCY_BUCKETS
from dynamo_cli.core.queue import QueuedRequest
from dynamo_cli.errors import Overloaded, RateLimited, RequestError

KEY_INDEX_SCOPE = "dyn.api_key_index"
"""Where the gate leaves the index of the request's API key (frontend/auth.py)."""
BATCH_TENANT = "batch"
"""The tenant of the Batch API's own requests (frontend/internal.py): no limits, the background class."""
MINUTE_S = 60.0
TENANT_HEADER_BYTES, CLASS_HEADER_BYTES = TENANT_HEADER.encode(), CLASS_HEADER.encode()


@dataclass(slots=True)
class TenantState:
    """One tenant's limits and what it uses now."""

    spec: TenantSpec
    inflight: int = 0
    tokens: float = 0.0
    """Its tokens-a-minute bucket (full: `spec.tokens_per_minute`)."""
    updated_at: float = 0.0

    def refill(self, now: float) -> float:
        rate = self.spec.tokens_per_minute
        self.tokens = min(float(rate), self.tokens + (now - self.updated_at) * rate / MINUTE_S)
        self.updated_at = now
        return self.tokens


@dataclass(frozen=True, slots=True)
class Tenancy:
    """A request's tenant and class, as the queue and the limits see them."""

    state: TenantState | None
    """None: the Batch API's own request (no limits)."""
    priority_class: PriorityClass

    @property
    def spec(self) -> TenantSpec:
        return self.state.spec if self.state is not None else TenantSpec(BATCH_TENANT)

    @property
    def name(self) -> str:
        return self.spec.name

    def queued(self, queued: QueuedRequest) -> QueuedRequest:
        """`queued` as its tenant's: its share, class and queue limit."""
        spec = self.spec
        return dataclasses.replace(
            queued, tenant=spec.name, weight=spec.weight, priority_class=self.priority_class, max_queued=spec.max_queued
        )


class TenantSeries:
    """`dynamo_frontend_tenant_*`: requests by status, tokens by kind, queue waits and rejections by limit."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        r = registry
        self.requests = Counter(f"{prefix}_tenant_requests", "Requests by tenant", ["tenant", "status"], registry=r)
        self.tokens = Counter(f"{prefix}_tenant_tokens", "Tokens: prompt | output", ["tenant", "kind"], registry=r)
        self.queue_wait = Histogram(
            f"{prefix}_tenant_queue_wait_seconds",
            "Queued for a worker",
            ["tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rejections = Counter(f"{prefix}_tenant_rejections", "429s by limit", ["tenant", "limit"], registry=r)
        self._labelled: dict[str, set[tuple[Counter | Histogram, tuple[str, ...]]]] = {}
        """Each tenant's series, so that a tenant forgotten loses them (bounded labels)."""

    def count(self, metric: Counter, tenant: str, label: str, amount: float = 1.0) -> None:
        self._labelled.setdefault(tenant, set()).add((metric, (tenant, label)))
        metric.labels(tenant, label).inc(amount)

    def observe_wait(self, tenant: str, seconds: float) -> None:
        self._labelled.setdefault(tenant, set()).add((self.queue_wait, (tenant,)))
        self.queue_wait.labels(tenant).observe(seconds)

    def forget(self, tenant: str) -> None:
        for metric, labels in self._labelled.pop(tenant, ()):
            metric.remove(*labels)


class Tenants:
    """Every tenant this frontend has seen: the key file's (always), and up to `max_tenants` named by headers."""

    def __init__(self, config: TenantConfig, series: TenantSeries, keys_on: bool) -> None:
        self.config = config
        self.series = series
        self._keys_on = keys_on
        by_name: dict[str, TenantState] = {}  # keys of one tenant share its state (merge_tenants: one spec each)
        for spec in config.key_tenants:
            if spec.name not in by_name:
                by_name[spec.name] = self._new(config.with_defaults(spec))
        self._by_key = [by_name[spec.name] for spec in config.key_tenants]
        self._named: collections.OrderedDict[str, TenantState] = collections.OrderedDict()
        """Tenants named by a header (or the default one), least recently seen first."""

    def identify(self, scope: Scope, headers: dict[bytes, bytes], internal: bool) -> Tenancy:
        """The request's tenant and class; a 400 naming the header for a bad `x-dyn-tenant` or class."""
        if internal:
            return Tenancy(None, PriorityClass.BACKGROUND)
        index = scope.get(KEY_INDEX_SCOPE)
        if index is not None and index < len(self._by_key):
            state = self._by_key[index]
        else:
            state = self._named_state(self._header_name(headers))
        spec = state.spec
        return Tenancy(state, class_header(headers.get(CLASS_HEADER_BYTES), spec.priority_class, spec.max_class))

    def admit(self, tenancy: Tenancy) -> None:
        """Count the request in flight, or a 429 naming the limit (counted: the request and its rejection)."""
        state = tenancy.state
        if state is None:
            return
        limit = state.spec.max_inflight
        if limit and state.inflight >= limit:
            what = f"tenant '{state.spec.name}' already has {limit} requests in flight (max-inflight)"
            refusal = RateLimited(what, 1.0, "max_inflight")
            self.refused(tenancy, refusal)
            self.series.count(self.series.requests, tenancy.name, "rejected")  # it never reaches `release`
            raise refusal
        state.inflight += 1

    def release(self, tenancy: Tenancy, status: str, output_tokens: int) -> None:
        """The response ended: out of flight, its output paid for, counted."""
        state = tenancy.state
        self.series.count(self.series.requests, tenancy.name, status)
        if output_tokens:
            self.series.count(self.series.tokens, tenancy.name, "output", output_tokens)
        if state is None:
            return
        state.inflight -= 1
        if state.spec.tokens_per_minute:
            state.refill(time.monotonic())
            state.tokens -= output_tokens

    def spend_prompt(self, tenancy: Tenancy, prompt_tokens: int) -> None:
        """Pay for a prompt from the tenant's tokens a minute, or a 429 with the seconds until it can."""
        self.series.count(self.series.tokens, tenancy.name, "prompt", prompt_tokens)
        state = tenancy.state
        rate = state.spec.tokens_per_minute if state is not None else 0
        if state is None or not rate:
            return
        need = min(prompt_tokens, rate)  # a prompt larger than a minute's worth waits for a full bucket
        have = state.refill(time.monotonic())
        if have < need:
            what = f"tenant '{state.spec.name}' is over its {rate} tokens a minute (tpm)"
            raise RateLimited(what, (need - have) * MINUTE_S / rate, "tokens_per_minute")
        state.tokens -= prompt_tokens

    def refused(self, tenancy: Tenancy, exc: RateLimited) -> None:
        """The request got a 429 for one of the tenant's limits (or its key's); `release` counts the request."""
        self.series.count(self.series.rejections, tenancy.name, exc.limit or "api_key")

    def waited(self, tenancy: Tenancy, seconds: float) -> None:
        self.series.observe_wait(tenancy.name, seconds)

    ##### Internals #####

    def _header_name(self, headers: dict[bytes, bytes]) -> str:
        value = headers.get(TENANT_HEADER_BYTES)
        if not value or self._keys_on or not self.config.header:
            return DEFAULT_TENANT
        name = value.decode("latin-1")
        if not TENANT_NAME.fullmatch(name):
            raise RequestError(f"header {TENANT_HEADER} must be 1-64 of A-Z a-z 0-9 . _ -", param=TENANT_HEADER)
        return name

    def _named_state(self, name: str) -> TenantState:
        named = self._named
        state = named.get(name)
        if state is not None:
            named.move_to_end(name)
            return state
        if len(named) >= self.config.max_tenants:
            idle = next((n for n, s in named.items() if not s.inflight), None)
            if idle is None:
                raise Overloaded(f"{len(named)} tenants have requests in flight (--tenant-table-size)", 1.0)
            del named[idle]
            self.series.forget(idle)
        state = named[name] = self._new(self.config.spec_of(name))
        return state

    @staticmethod
    def _new(spec: TenantSpec) -> TenantState:
        return TenantState(spec, tokens=float(spec.tokens_per_minute), updated_at=time.monotonic())
