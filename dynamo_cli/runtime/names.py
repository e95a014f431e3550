"""Dynamo's naming hierarchy: namespace → component → endpoint → instance."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NewType

from dynamo_cli.errors import ConfigError

InstanceId = NewType("InstanceId", int)
"""A process's id on the planes: its lease id (etcd) or a random 63-bit id (embedded)."""

_NAME = re.compile(r"^[a-z0-9_-]+$")


def check_name(kind: str, value: str) -> str:
    """Return `value` if it is a valid name part, else raise ConfigError naming the rule."""
    if not _NAME.match(value):
        raise ConfigError(f"{kind} '{value}' is invalid: use lowercase letters, digits, '-' and '_' only")
    return value


@dataclass(frozen=True, slots=True)
class EndpointName:
    """A served endpoint: `ns/component/endpoint`."""

    namespace: str
    """Deployment name (default `dynamo`)."""
    component: str
    """Role group, e.g. `backend`, `prefill`, `router`."""
    endpoint: str
    """Operation, e.g. `generate`."""

    def __post_init__(self) -> None:
        check_name("namespace", self.namespace)
        check_name("component", self.component)
        check_name("endpoint", self.endpoint)

    @classmethod
    def parse(cls, text: str) -> EndpointName:
        """Parse `ns/comp/ep`, `ns.comp.ep` or `dyn://ns.comp.ep`."""
        raw = text.removeprefix("dyn://")
        parts = raw.split("/") if "/" in raw else raw.split(".")
        if len(parts) != 3:
            raise ConfigError(f"endpoint '{text}' must look like namespace/component/endpoint")
        return cls(*parts)

    @property
    def path(self) -> str:
        """`ns/comp/ep`, the discovery key fragment."""
        return f"{self.namespace}/{self.component}/{self.endpoint}"

    def instance_key(self, instance_id: int) -> str:
        """Discovery key of one instance of this endpoint."""
        return f"v1/instances/{self.path}/{instance_id:x}"

    def card_key(self, instance_id: int) -> str:
        """Discovery key of the model card that instance serves."""
        return f"v1/mdc/{self.path}/{instance_id:x}"

    def __str__(self) -> str:
        return self.path


def component_subject(namespace: str, component: str, topic: str) -> str:
    """Event-plane subject for a component topic, as Dynamo spells it."""
    return f"namespace.{namespace}.component.{component}.{topic}"


def kv_events_subject(namespace: str) -> str:
    """Every component's KV events in a namespace (what routers subscribe to)."""
    return component_subject(namespace, "*", "kv-events")


def parse_instance_key(key: str) -> tuple[EndpointName, InstanceId]:
    """Split `v1/{instances|mdc}/ns/comp/ep/{id:x}` into its endpoint and instance id."""
    parts = key.split("/")
    if len(parts) < 6:
        raise ValueError(f"not an instance key: {key}")
    return EndpointName(parts[2], parts[3], parts[4]), InstanceId(int(parts[5], 16))


def frontends_prefix(namespace: str) -> str:
    """Discovery prefix of the frontends' records (leased: a frontend's goes with its process)."""
    return f"v1/frontends/{namespace}/"


def frontend_key(namespace: str, instance_id: int) -> str:
    """Discovery key of one frontend's record."""
    return f"{frontends_prefix(namespace)}{instance_id:x}"
