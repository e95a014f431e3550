"""The multi-tenant workload of `dyn bench`: several tenants, each with its own prompts, load, priority class and
identity, sending at once; and the figures of each.

NOTE: a tenant is one load runner of its own (open loop at its rate, or closed loop at its concurrency) on the
run's shared HTTP client, all running together until each meets --num-requests or --duration. A tenant is known
to the server by its key (`Authorization: Bearer KEY`), else by `x-dyn-tenant: NAME`, and asks for a class with
`x-dyn-priority-class`. A 429 is one of its rejections, counted with the `Retry-After` it carried, never retried.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from dynamo_cli.bench.http import HttpClient, RequestRecord
from dynamo_cli.bench.load import LoadConfig, LoadRunner, OnRecord, RequestBuilder
from dynamo_cli.bench.metrics import RequestMetrics, percentile
from dynamo_cli.bench.workload import Conversation
from dynamo_cli.errors import ConfigError

TENANT_HEADER = "x-dyn-tenant"
CLASS_HEADER = "x-dyn-priority-class"
PRIORITY_CLASSES = ("bulk", "default", "interactive", "system")
"""The classes a client may ask for in `x-dyn-priority-class` (the frontend's contract, config/tenants.py: the
bench, a client, does not import the server's layers; tests/bench/test_tenants.py holds the two equal)."""
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_KEY = re.compile(r"[\x21-\x7e]{1,512}")
_FIELDS = ("name", "isl", "osl", "rate", "concurrency", "weight", "class", "key")


@dataclass(frozen=True, slots=True)
class TenantLoad:
    """One tenant of a multi-tenant run: who it is, what it sends, how fast."""

    name: str
    """Its name: sent as `x-dyn-tenant` when it has no key, and its row of the report."""
    isl: float | None = None
    """Mean input tokens (None: --isl)."""
    osl: float | None = None
    """Mean output tokens (None: --osl)."""
    rate: float | None = None
    """Requests per second, Poisson arrivals (open loop)."""
    concurrency: int | None = None
    """Requests in flight (closed loop); neither this nor `rate`: the run's --concurrency / --request-rate."""
    weight: float = 1.0
    """The share of the server it is meant to get (the report sets its share of output tokens beside it)."""
    priority_class: str | None = None
    """Sent as `x-dyn-priority-class` (system, interactive, default, bulk); None: not sent."""
    key: str | None = field(default=None, repr=False)
    """Its API key, sent as `Authorization: Bearer KEY` (never reported)."""

    def headers(self) -> tuple[tuple[str, str], ...]:
        """The headers each of its requests carries."""
        who = ("authorization", f"Bearer {self.key}") if self.key else (TENANT_HEADER, self.name)
        return (who, (CLASS_HEADER, self.priority_class)) if self.priority_class else (who,)

    def load(self, base: LoadConfig, index: int) -> LoadConfig:
        """The run's load with this tenant's rate or concurrency (and a seed of its own)."""
        seed = base.seed + 7919 * (index + 1)
        if self.rate is not None:
            return dataclasses.replace(base, request_rate=self.rate, concurrency=None, arrival="poisson", seed=seed)
        if self.concurrency is not None:
            return dataclasses.replace(base, request_rate=None, concurrency=self.concurrency, seed=seed)
        return dataclasses.replace(base, seed=seed)

    def public(self) -> dict[str, Any]:
        """What the report says of it: everything but its key."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "key"} | {
            "has_key": self.key is not None
        }


def parse_tenant(spec: str) -> TenantLoad:
    """`name=a,isl=4000,osl=64,rate=5,weight=1,class=bulk,key=sk-x` → a TenantLoad; ConfigError naming the field."""
    values: dict[str, str] = {}
    for item in spec.split(","):
        key, eq, value = item.strip().partition("=")
        if not eq or key not in _FIELDS:
            raise ConfigError(
                f"--tenant {_shown(spec)}: {_shown(item)} is not one of {', '.join(f + '=' for f in _FIELDS)}"
            )
        if key in values:
            raise ConfigError(f"--tenant {_shown(spec)}: {key}= is given twice")
        values[key] = value.strip()
    if "name" not in values:
        raise ConfigError(f"--tenant {_shown(spec)}: name= is required (name=NAME,...)")
    if "rate" in values and "concurrency" in values:
        raise ConfigError(f"--tenant {_shown(spec)}: give rate= (open loop) or concurrency= (closed loop), not both")
    name = values.pop("name")
    if not _NAME.fullmatch(name):
        raise ConfigError(f"--tenant {_shown(spec)}: name={name!r} must be 1-64 of A-Z a-z 0-9 . _ -")
    return TenantLoad(name=name, **{_attribute(key): _value(spec, key, raw) for key, raw in values.items()})


def _attribute(key: str) -> str:
    return "priority_class" if key == "class" else key


def _value(spec: str, key: str, raw: str) -> Any:
    if key == "class":
        if raw.lower() not in PRIORITY_CLASSES:
            raise ConfigError(f"--tenant {_shown(spec)}: class={raw} is not one of {', '.join(PRIORITY_CLASSES)}")
        return raw.lower()
    if key == "key":
        if not _KEY.fullmatch(raw):
            raise ConfigError(f"--tenant {_shown(spec)}: key= must be printable, without spaces or commas")
        return raw
    try:
        number = int(raw) if key == "concurrency" else float(raw)
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number > 0):
        kind = "a whole number" if key == "concurrency" else "a number"
        raise ConfigError(f"--tenant {_shown(spec)}: {key}={raw} must be {kind} > 0")
    return number


def _shown(text: str) -> str:
    """`text` quoted, any key in it masked: error lines are printed and logged."""
    return repr(re.sub(r"key=[^,]*", "key=…", text))


def parse_tenants(specs: Iterable[str]) -> tuple[TenantLoad, ...]:
    """Every `--tenant` given; ConfigError for a bad one, or for a name given twice."""
    tenants = tuple(parse_tenant(spec) for spec in specs)
    names = [t.name for t in tenants]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"--tenant name={twice[0]} is given twice; each tenant needs a name of its own")
    return tenants


def as_tenant(tenant: TenantLoad, conversations: Iterator[Conversation]) -> Iterator[Conversation]:
    """`conversations`, sent as `tenant`: its headers on each request, its name on each record."""
    headers = tenant.headers()
    for conversation in conversations:
        yield dataclasses.replace(conversation, headers=conversation.headers + headers, tenant=tenant.name)


Workloads = Callable[[int, TenantLoad], tuple[Iterator[Conversation], Iterator[Conversation]]]
"""(tenant index, tenant) → its measured and warm-up conversations."""


async def run_tenants(
    client: HttpClient,
    builder: RequestBuilder,
    tenants: Sequence[TenantLoad],
    base: LoadConfig,
    workloads: Workloads,
    on_record: OnRecord | None = None,
) -> list[RequestRecord]:
    """Run every tenant's load at once; their records, tenant by tenant."""
    runners = [LoadRunner(client, builder, on_record) for _ in tenants]
    async with asyncio.TaskGroup() as group:
        for index, (tenant, runner) in enumerate(zip(tenants, runners, strict=True)):
            conversations, warmup = workloads(index, tenant)
            group.create_task(runner.run(tenant.load(base, index), conversations, warmup))
    return [record for runner in runners for record in runner.records]


def tenant_connections(tenants: Sequence[TenantLoad], base: LoadConfig, unbounded: int) -> int:
    """Connections the tenants need at most at once: their concurrencies, summed (`unbounded` for an open loop)."""
    loads = [t.load(base, i) for i, t in enumerate(tenants)]
    if any(load.request_rate is not None and load.concurrency is None for load in loads):
        return unbounded
    return sum(load.concurrency or 1 for load in loads)


##### figures by tenant #####


@dataclass(frozen=True, slots=True)
class TenantFigures:
    """One tenant's figures: counts, latencies in ms, its output throughput and share, the Retry-After of its 429s."""

    name: str
    priority_class: str | None
    weight: float
    num_sent: int
    num_completed: int
    num_rejected: int
    """Answered 429 (Too Many Requests)."""
    num_errors: int
    """Failed otherwise."""
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    e2e_p50: float
    e2e_p99: float
    output_token_throughput: float
    """Its output tokens / the run's duration."""
    output_share: float | None
    """Its share of every tenant's output tokens (beside `weight_share`, what it was meant to get)."""
    weight_share: float
    retry_after_mean: float | None
    """Mean `Retry-After` (s) of its 429s that carried one; None: none did."""
    retry_after_max: float | None


def tenant_figures(
    metrics: Sequence[RequestMetrics], tenants: Sequence[TenantLoad], duration_s: float
) -> list[TenantFigures]:
    """Each tenant's figures, in the order the tenants were given."""
    total_output = sum(m.output_tokens for m in metrics if m.is_ok)
    total_weight = sum(t.weight for t in tenants)
    return [
        _figures(t, [m for m in metrics if m.tenant == t.name], duration_s, total_output, t.weight / total_weight)
        for t in tenants
    ]


def _figures(
    tenant: TenantLoad, mine: Sequence[RequestMetrics], duration_s: float, total_output: int, weight_share: float
) -> TenantFigures:
    ok = [m for m in mine if m.is_ok]
    rejected = [m for m in mine if m.status == 429]
    ttft = sorted(m.ttft for m in ok if m.ttft is not None)
    e2e = sorted(m.e2e for m in ok)
    waits = [m.retry_after for m in rejected if m.retry_after is not None]
    output = sum(m.output_tokens for m in ok)
    return TenantFigures(
        name=tenant.name,
        priority_class=tenant.priority_class,
        weight=tenant.weight,
        num_sent=len(mine),
        num_completed=len(ok),
        num_rejected=len(rejected),
        num_errors=len(mine) - len(ok) - len(rejected),
        ttft_p50=percentile(ttft, 50),
        ttft_p90=percentile(ttft, 90),
        ttft_p99=percentile(ttft, 99),
        e2e_p50=percentile(e2e, 50),
        e2e_p99=percentile(e2e, 99),
        output_token_throughput=output / duration_s if duration_s > 0 else 0.0,
        output_share=output / total_output if total_output else None,
        weight_share=weight_share,
        retry_after_mean=sum(waits) / len(waits) if waits else None,
        retry_after_max=max(waits) if waits else None,
    )
