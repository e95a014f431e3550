"""What a rendered deployment's objects are called on Kubernetes: names, labels, ports, Secrets and mount paths,
shared by `dyn k8s render` (which writes them) and `dyn k8s status` (which reads them back)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from dynamo_cli import __version__
from dynamo_cli.errors import ConfigError

PART_OF = "dyn"
"""`app.kubernetes.io/part-of` and `.../name` of every object."""
MANAGED_BY = "dyn-k8s-render"


class Part(Enum):
    """One rendered component: its name suffix and `app.kubernetes.io/component` label."""

    FRONTEND = "frontend"  # `dyn serve --workers 0`: the OpenAI HTTP server and router
    WORKER = "worker"  # aggregated workers (`dyn worker --role both`)
    DECODE = "decode"  # --disagg: decode workers
    PREFILL = "prefill"  # --disagg: prefill workers
    ROUTER = "router"  # --router remote: `dyn router` replicas
    PLANNER = "planner"  # --planner: `dyn plan run --connector kubernetes`
    ETCD = "etcd"  # --etcd bundled
    NATS = "nats"  # --nats bundled


WORKER_PARTS = (Part.WORKER, Part.DECODE, Part.PREFILL)
"""The worker pools, the Deployments (or LeaderWorkerSets) the planner scales."""


@dataclass(frozen=True, slots=True)
class Workload:
    """The kind of object a worker pool is: what the planner's Role grants, KEDA's ScaledObject targets and the
    planner's connector scales (each through its Scale subresource)."""

    kind: str
    api_version: str
    plural: str
    """The resource name (`deployments`): `deployments/scale` in a Role."""

    @property
    def group(self) -> str:
        """The API group (`apps`)."""
        return self.api_version.rpartition("/")[0]


DEPLOYMENT = Workload("Deployment", "apps/v1", "deployments")
LEADER_WORKER_SET = Workload("LeaderWorkerSet", "leaderworkerset.x-k8s.io/v1", "leaderworkersets")
"""A pool of multi-node workers (kubernetes-sigs/lws): each replica a group of pods that lives and dies together."""
WORKLOADS = {w.kind: w for w in (DEPLOYMENT, LEADER_WORKER_SET)}
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
"""The label LWS puts on every pod of a group: its index in the group, "0" on the leader."""


@dataclass(frozen=True, slots=True)
class Ports:
    """The fixed container ports (a NetworkPolicy and a probe need a port known before the pod starts)."""

    http: int = 8000
    """The frontend's OpenAI HTTP port (the only one a NetworkPolicy admits from outside the namespace)."""
    request_plane: int = 9000
    """Workers' and routers' request plane."""
    kv_transfer: int = 9100
    """Prefill workers' KV transfer server."""
    system: int = 9090
    """Every worker's, router's and planner's system server: `/live`, `/health`, `/metrics`."""
    etcd_client: int = 2379
    etcd_peer: int = 2380
    nats_client: int = 4222
    nats_monitor: int = 8222


PORTS = Ports()


@dataclass(frozen=True, slots=True)
class Names:
    """The names of one rendered deployment (`--name`, default `dyn`) in its namespace."""

    instance: str = "dyn"
    """`app.kubernetes.io/instance`: lets two deployments share a namespace."""

    def of(self, part: Part) -> str:
        """A component's Deployment/StatefulSet/Service name: `dyn-frontend`, `dyn-decode`..."""
        return f"{self.instance}-{part.value}"

    def selector(self, part: Part) -> dict[str, str]:
        """The labels a component's pods are selected by (immutable once applied: no version in them)."""
        return {
            "app.kubernetes.io/name": PART_OF,
            "app.kubernetes.io/instance": self.instance,
            "app.kubernetes.io/component": part.value,
        }

    def labels(self, part: Part | None) -> dict[str, str]:
        """Every label of a component's objects and pods (None: an object of the whole deployment)."""
        return {
            **(self.selector(part) if part is not None else self.instance_selector()),
            "app.kubernetes.io/part-of": PART_OF,
            "app.kubernetes.io/version": __version__,
            "app.kubernetes.io/managed-by": MANAGED_BY,
        }

    def instance_selector(self) -> dict[str, str]:
        """Every pod of this deployment (the NetworkPolicy's peers, `dyn k8s status`'s listing)."""
        return {"app.kubernetes.io/name": PART_OF, "app.kubernetes.io/instance": self.instance}

    @property
    def cluster_secret(self) -> str:
        """Secret with key `secret`: the request plane's shared secret (hex)."""
        return f"{self.instance}-cluster-secret"

    @property
    def api_keys(self) -> str:
        """Secret with key `keys`: the frontend's API keys, one a line."""
        return f"{self.instance}-api-keys"

    @property
    def tls(self) -> str:
        """Secret of type kubernetes.io/tls: the frontend's certificate and key (and `ca.crt` with --tls-ca-file)."""
        return f"{self.instance}-tls"

    @property
    def planes(self) -> str:
        """Secret mounted at PLANES_DIR: files the etcd/NATS URLs name (password-file=, ca=, creds= ...)."""
        return f"{self.instance}-planes"

    @property
    def batches(self) -> str:
        """PersistentVolumeClaim mounted at BATCHES_DIR: the frontend's SQLite batch database and its files."""
        return f"{self.instance}-batches"

    @property
    def batch_db(self) -> str:
        """Secret with key `password`: the PostgreSQL batch database's password (the frontend's PGPASSWORD)."""
        return f"{self.instance}-batch-db"

    @property
    def planner_profile(self) -> str:
        """ConfigMap with key `profile.json`: the planner's profile (`dyn plan profile`)."""
        return f"{self.instance}-planner-profile"


CLUSTER_SECRET_KEY = "secret"
API_KEYS_KEY = "keys"
BATCH_DB_KEY = "password"
SECRETS_DIR = "/etc/dyn"
API_KEYS_DIR = f"{SECRETS_DIR}/api-keys"
TLS_DIR = f"{SECRETS_DIR}/tls"
PLANES_DIR = f"{SECRETS_DIR}/planes"
PROFILE_DIR = f"{SECRETS_DIR}/profile"
BATCHES_DIR = "/var/lib/dyn/batches"
MODELS_DIR = "/models"
"""Where `--model-pvc` is mounted (read-only)."""
MODEL_CACHE_DIR = "/var/cache/dyn-models"
"""Where `--model-cache-pvc` is mounted (read-write) and HF_HOME points: hub downloads, shared by the pods."""
HF_TOKEN_KEY = "token"
"""The key of `--hf-token-secret` whose value is HF_TOKEN."""
DEFAULT_K8S_NAMESPACE = "dyn"
"""The namespace `dyn k8s render` writes to, `dyn k8s status` reads and `dyn plan run --connector kubernetes` scales
when none is given."""


_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
MAX_NAME = 40
"""The longest `--namespace` / `--name`: `NAME-planner-profile` and the Service `NAME-frontend` stay valid."""


def check_name(flag: str, value: str) -> str:
    """`value` if the API server takes it as a namespace or an object name's prefix (a DNS-1035 label, short
    enough for the suffixes), else ConfigError naming the flag."""
    if not _LABEL.fullmatch(value) or len(value) > MAX_NAME:
        raise ConfigError(
            f"{flag} '{value}' is not a Kubernetes name: lower-case letters, digits and '-', starting with a letter, "
            f"at most {MAX_NAME} characters"
        )
    return value
