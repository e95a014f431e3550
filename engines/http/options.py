"""The http engine's options (`--engine-arg KEY=VALUE`), checked once at start."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from dynamo_cli.errors import ConfigError

API_KEY_ENV = "DYN_BACKEND_API_KEY"
"""The bearer key the backend wants, if any: an environment variable, so that it is never on a command line."""

DEFAULT_BLOCK_SIZE = 16
"""vLLM's default: the block size the router hashes prompts with when neither `--block-size` nor the backend's
`/metrics` says one."""
DEFAULT_BLOCKS = 16384
"""The KV capacity assumed for a backend that does not say its own."""


@dataclass(frozen=True, slots=True)
class HttpOptions:
    url: str
    """The backend's base URL, scheme and host (`http://10.0.0.7:8000`); its API is under `/v1`."""
    served_model: str | None = None
    """The model id to ask the backend for; None: the one its `/v1/models` lists."""
    num_gpu_blocks: int | None = None
    """The backend's KV capacity in blocks, as the router's cost model counts it; None: what its `/metrics` says
    (vLLM's `vllm:cache_config_info`), else DEFAULT_BLOCKS."""
    max_num_seqs: int = 256
    start_timeout_s: float = 300.0
    """How long to wait for the backend to answer at start (an engine server may load for minutes)."""
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    """The longest wait for the next piece of a stream (a long prefill, a queue at the backend)."""
    api_key: str | None = None
    kv_events: str | None = None
    """The backend's ZMQ KV event publisher (`tcp://HOST:PORT` or `ipc://PATH`, vLLM's `--kv-events-config` endpoint,
    which it binds); None: it
    publishes none reachable here, and a KV router routes to it approximately."""
    kv_replay: str | None = None
    """Its replay endpoint (vLLM's `replay_endpoint`): buffered events at start and after a gap."""
    kv_topic: str = ""
    """The topic its events are published under (`""`: any)."""

    @classmethod
    def of(cls, extra: dict[str, Any]) -> HttpOptions:
        """The options in `extra` (EngineArgs.extra); ConfigError naming one that is missing or wrong."""
        unknown = sorted(set(extra) - KNOWN)
        if unknown:
            raise ConfigError(f"--engine http takes no option {unknown[0]}; it takes {', '.join(sorted(KNOWN))}")
        url = str(extra.get("url") or "")
        if not url:
            raise ConfigError("--engine http needs the backend's URL: --engine-arg url=http://HOST:PORT")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise ConfigError(f"--engine-arg url={url}: give http(s)://HOST[:PORT][/PATH], no query")
        numbers = {}
        for name in ("num_gpu_blocks", "max_num_seqs", "start_timeout_s", "connect_timeout_s", "read_timeout_s"):
            if name in extra and extra[name] is not None:
                numbers[name] = _positive(name, extra[name])
        model = extra.get("served_model")
        return cls(
            url=url.rstrip("/").removesuffix("/v1"),
            served_model=str(model) if model else None,
            api_key=os.environ.get(API_KEY_ENV) or None,
            kv_events=_endpoint("kv_events", extra.get("kv_events")),
            kv_replay=_endpoint("kv_replay", extra.get("kv_replay")),
            kv_topic=str(extra.get("kv_topic") or ""),
            **numbers,
        )


KNOWN = frozenset(
    {"url", "served_model", "num_gpu_blocks", "max_num_seqs", "start_timeout_s", "connect_timeout_s", "read_timeout_s"}
    | {"kv_events", "kv_replay", "kv_topic"}
)


def _endpoint(name: str, value: Any) -> str | None:
    """A ZMQ endpoint to connect to, `tcp://HOST:PORT` (or `ipc://PATH` on the backend's host); None if not given."""
    if value in (None, ""):
        return None
    text = str(value)
    if text.startswith("ipc://") and len(text) > len("ipc://"):
        return text
    host, _, port = text.removeprefix("tcp://").rpartition(":")
    if not text.startswith("tcp://") or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--engine-arg {name}={value}: give the backend's tcp://HOST:PORT (or ipc://PATH)")
    return text


def _positive(name: str, value: Any) -> Any:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--engine-arg {name}={value} is not a number") from None
    if not number > 0:
        raise ConfigError(f"--engine-arg {name} must be > 0, got {value}")
    return number if name.endswith("_s") else int(number)
