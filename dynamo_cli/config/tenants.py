"""Tenants: who shares the deployment, with what weight, limits and priority class (frontend/tenants.py enforces
them; core/queue.py shares the wait queue between them by work).

A tenant comes from the API key (an `--api-key-file` line may name the key's tenant and its share), else, with
API keys off, from the `x-dyn-tenant` header; a request with neither is the tenant "default". A key file line:

    KEY [tenant=NAME] [weight=W] [max-inflight=N] [tpm=N] [max-queued=N] [class=C] [max-class=C]

Several keys may share a tenant (its settings then given once, or the same on every line). A key with no
`tenant=` is a tenant of its own, named `key-` and the first 8 hex digits of its SHA-256.
"""

from __future__ import annotations

import enum
import hashlib
import re
from dataclasses import dataclass, fields, replace
from typing import Any

from dynamo_cli.errors import ConfigError, RequestError
from dynamo_cli.settings import OVERLOAD, SECURITY, setting

DEFAULT_TENANT = "default"
"""The tenant of a request that names none (no API keys, no `x-dyn-tenant`)."""
TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
TENANT_HEADER = "x-dyn-tenant"
"""A request's tenant when API keys are off (`--tenant-header`)."""
CLASS_HEADER = "x-dyn-priority-class"
"""The priority class a request asks for."""
"""What a tenant's name may be (a header's value, a metric label)."""


class PriorityClass(enum.IntEnum):
    """Served strictly in this order, highest first; fairness between tenants applies within a class. The Batch
    API's lines are BACKGROUND, below every class a client may ask for."""

    BACKGROUND = 0
    BULK = 1
    DEFAULT = 2
    INTERACTIVE = 3
    SYSTEM = 4

    @property
    def label(self) -> str:
        return self.name.lower()


PREEMPTIBLE = PriorityClass.BULK
"""Running requests of this class and below may be paused for a waiting request of `PREEMPTING` or above."""
PREEMPTING = PriorityClass.INTERACTIVE
CLIENT_CLASSES = {c.label: c for c in PriorityClass if c is not PriorityClass.BACKGROUND}


def parse_class(value: str, what: str) -> PriorityClass:
    """A client-facing class name (system, interactive, default, bulk); ConfigError naming `what` otherwise."""
    found = CLIENT_CLASSES.get(value.strip().lower())
    if found is None:
        raise ConfigError(f"{what} '{value}' is not a priority class; use one of: {', '.join(CLIENT_CLASSES)}")
    return found


def class_header(value: bytes | None, default: PriorityClass, highest: PriorityClass) -> PriorityClass:
    """The class `x-dyn-priority-class` asks for (else `default`), at most `highest`: a 400 naming the header."""
    if not value:
        return default
    found = CLIENT_CLASSES.get(value.decode("latin-1").strip().lower())
    if found is None:
        raise RequestError(
            f"header x-dyn-priority-class must be one of: {', '.join(CLIENT_CLASSES)}", param="x-dyn-priority-class"
        )
    if found > highest:
        raise RequestError(
            f"this tenant may ask for priority class {highest.label} at most, not {found.label}",
            param="x-dyn-priority-class",
        )
    return found


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One tenant's share and limits (0: the deployment's `--tenant-*` default)."""

    name: str = DEFAULT_TENANT
    weight: float = 1.0
    """Its share of the queue relative to other tenants' (by work: tokens)."""
    max_inflight: int = 0
    tokens_per_minute: int = 0
    """Prompt + output tokens a minute (a token bucket of a minute's worth)."""
    max_queued: int = 0
    """Its requests waiting in a model's queue at once."""
    priority_class: PriorityClass = PriorityClass.DEFAULT
    """The class of its requests that ask for none."""
    max_class: PriorityClass = PriorityClass.INTERACTIVE
    """The highest class it may ask for (`x-dyn-priority-class`)."""


_KEYS = {
    "tenant": ("name", str),
    "weight": ("weight", float),
    "max-inflight": ("max_inflight", int),
    "tpm": ("tokens_per_minute", int),
    "max-queued": ("max_queued", int),
    "class": ("priority_class", PriorityClass),
    "max-class": ("max_class", PriorityClass),
}


def key_tenant(key: str, attributes: list[str], where: str) -> TenantSpec:
    """The tenant a key file line's `name=value` attributes give its key; ConfigError naming the attribute."""
    values: dict[str, Any] = {"name": "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]}
    for attribute in attributes:
        name, eq, raw = attribute.partition("=")
        if not eq or name not in _KEYS:
            raise ConfigError(f"{where}: '{attribute}' is not one of {', '.join(k + '=' for k in _KEYS)}")
        field_name, kind = _KEYS[name]
        try:
            value = parse_class(raw, f"{where}: {name}") if kind is PriorityClass else kind(raw)
        except ValueError:
            raise ConfigError(f"{where}: {name}={raw} is not a valid {kind.__name__}") from None
        values[field_name] = value
    spec = TenantSpec(**values)
    _check(spec, where)
    return spec


def _check(spec: TenantSpec, where: str) -> None:
    if not TENANT_NAME.fullmatch(spec.name):
        raise ConfigError(f"{where}: tenant '{spec.name}' must be 1-64 of A-Z a-z 0-9 . _ -")
    if not 0.0 < spec.weight <= 1000.0:
        raise ConfigError(f"{where}: weight={spec.weight:g} must be in (0, 1000]")
    if min(spec.max_inflight, spec.tokens_per_minute, spec.max_queued) < 0:
        raise ConfigError(f"{where}: max-inflight, tpm and max-queued must be >= 0")
    if spec.priority_class > spec.max_class:
        raise ConfigError(f"{where}: class={spec.priority_class.label} is above max-class={spec.max_class.label}")


def merge_tenants(specs: list[TenantSpec], lines: list[str]) -> tuple[TenantSpec, ...]:
    """One spec per key: keys of one tenant share the settings given on any of their lines (ConfigError when two
    lines give a tenant different ones)."""
    merged: dict[str, TenantSpec] = {}
    default = TenantSpec()
    for spec, where in zip(specs, lines, strict=True):
        seen = merged.get(spec.name)
        if seen is None or seen == replace(default, name=spec.name):
            merged[spec.name] = spec
        elif spec != replace(default, name=spec.name) and spec != seen:
            raise ConfigError(f"{where}: tenant '{spec.name}' has other settings on an earlier line; give them once")
    return tuple(merged[spec.name] for spec in specs)


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """How the frontend tells tenants apart and what each may use (per-tenant lines in the key file override the
    limits)."""

    key_tenants: tuple[TenantSpec, ...] = ()
    """The tenant of each API key, by its index in `AuthConfig.api_keys` (from `--api-key-file`)."""
    header: bool = setting(True, "--tenant-header/--no-tenant-header", env="DYN_TENANT_HEADER", panel=SECURITY)
    """With API keys off, a request's tenant is its `x-dyn-tenant` header (with keys on, always its key's)."""
    max_inflight: int = setting(0, "--tenant-max-inflight", env="DYN_TENANT_MAX_INFLIGHT", panel=OVERLOAD)
    """Requests in flight at once per tenant (0: no limit); over it: 429 naming the limit."""
    tokens_per_minute: int = setting(0, "--tenant-tokens-per-minute", env="DYN_TENANT_TPM", panel=OVERLOAD)
    """Prompt and output tokens per tenant a minute (0: no limit); a prompt the bucket cannot pay: 429 with the
    seconds until it can."""
    max_queued: int = setting(0, "--tenant-max-queued", env="DYN_TENANT_MAX_QUEUED", panel=OVERLOAD)
    """Requests per tenant waiting in a model's queue at once (0: only the queue's own size)."""
    max_tenants: int = setting(1024, "--tenant-table-size", env="DYN_TENANT_TABLE_SIZE", panel=OVERLOAD)
    """Tenants tracked at once (header-named ones beyond it: the least recently seen is forgotten)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and value < 0:
                raise ConfigError(f"--tenant-{f.name.replace('_', '-')} must be >= 0, got {value}")
        if self.max_tenants < 1:
            raise ConfigError(f"--tenant-table-size must be >= 1, got {self.max_tenants}")

    def spec_of(self, name: str) -> TenantSpec:
        """A tenant named by a header, or one the key file does not describe: the deployment's defaults."""
        return self.with_defaults(TenantSpec(name))

    def with_defaults(self, spec: TenantSpec) -> TenantSpec:
        """A key file's tenant, its unset limits the deployment's."""
        return replace(
            spec,
            max_inflight=spec.max_inflight or self.max_inflight,
            tokens_per_minute=spec.tokens_per_minute or self.tokens_per_minute,
            max_queued=spec.max_queued or self.max_queued,
        )
