"""Options that are not one config field each: they feed a computed one (the engine's `extra` options, the
API keys, the cluster secret), or they belong to a command of their own. Every other option is built from
the configs' declared settings (cli/settings.py)."""

from __future__ import annotations

import json
import os
from importlib.util import find_spec
from pathlib import Path
from typing import Annotated, Any

import typer

from dynamo_cli.cli import settings
from dynamo_cli.config import CLUSTER_SECRET_ENV, PlanesConfig, WorkerConfig
from dynamo_cli.engine import registered_engines
from dynamo_cli.errors import ConfigError
from dynamo_cli.runtime.handshake import MIN_SECRET_BYTES, new_secret
from dynamo_cli.settings import ENGINE, SECURITY

_LIBRARY = {"vllm": "vllm", "sglang": "sglang", "trtllm": "tensorrt_llm", "llamacpp": "llama_cpp"}


def engines_help() -> str:
    """`mocker (installed), vllm (not installed: pip install 'dynamo-cli[vllm]')...`"""
    parts = []
    for name in sorted(registered_engines()):
        library = _LIBRARY.get(name)
        ok = library is None or find_spec(library) is not None
        status = "installed" if ok else "needs pip install 'dynamo-cli\\[" + name + "]'"  # \[: not rich markup
        parts.append(f"{name} ({status})")
    return "Engine plugin: " + ", ".join(parts)


HELP = {"--engine": engines_help()}
"""Help computed at start: which engines are installed."""

Engine = settings.annotated(WorkerConfig, "engine", help=HELP["--engine"])
Model = settings.annotated(WorkerConfig, "model")
ServedName = settings.annotated(WorkerConfig, "served_model_name")
Namespace = settings.annotated(WorkerConfig, "namespace")
ContextLength = settings.annotated(WorkerConfig, "context_length")
Discovery = settings.annotated(PlanesConfig, "discovery")
Events = settings.annotated(PlanesConfig, "events")
LeaseTtl = settings.annotated(PlanesConfig, "lease_ttl")


##### The engine's own options (they make up WorkerConfig.extra) #####

SpeedupRatio = Annotated[
    float | None,
    typer.Option(
        "--speedup-ratio", envvar="DYN_SPEEDUP_RATIO", help="mocker: divide simulated time.", rich_help_panel=ENGINE
    ),
]
NumGpuBlocks = Annotated[
    int | None,
    typer.Option(
        "--num-gpu-blocks", envvar="DYN_NUM_GPU_BLOCKS", help="mocker: KV capacity in blocks.", rich_help_panel=ENGINE
    ),
]
MaxNumSeqs = Annotated[
    int | None,
    typer.Option("--max-num-seqs", envvar="DYN_MAX_NUM_SEQS", help="Sequences in a batch.", rich_help_panel=ENGINE),
]
Deterministic = Annotated[
    bool,
    typer.Option(
        "--deterministic",
        envvar="DYN_DETERMINISTIC",
        help="Greedy output independent of batching, prefix hits and migration (engine option deterministic=true;"
        " slower).",
        rich_help_panel=ENGINE,
    ),
]
EngineArg = Annotated[
    list[str] | None,
    typer.Option(
        "--engine-arg",
        envvar="DYN_ENGINE_ARG",
        help="Engine option KEY=VALUE (repeatable; JSON values).",
        rich_help_panel=ENGINE,
    ),
]
ExtraEngineArgs = Annotated[
    str | None,
    typer.Option(
        "--extra-engine-args",
        envvar="DYN_EXTRA_ENGINE_ARGS",
        help="JSON object of engine options.",
        rich_help_panel=ENGINE,
    ),
]

ENGINE_OPTIONS = [
    settings.option("speedup_ratio", SpeedupRatio, None),
    settings.option("num_gpu_blocks", NumGpuBlocks, None),
    settings.option("max_num_seqs", MaxNumSeqs, None),
    settings.option("deterministic", Deterministic, False),
    settings.option("engine_arg", EngineArg, None),
    settings.option("extra_engine_args", ExtraEngineArgs, None),
]
"""The options `engine_options` reads, for `dyn serve` and `dyn worker`."""


def engine_options(values: dict[str, Any]) -> dict[str, Any]:
    """WorkerConfig.extra from ENGINE_OPTIONS' values (taken out of `values`)."""
    return engine_extra(
        values.pop("engine_arg"),
        values.pop("extra_engine_args"),
        speedup_ratio=values.pop("speedup_ratio"),
        num_gpu_blocks=values.pop("num_gpu_blocks"),
        max_num_seqs=values.pop("max_num_seqs"),
        deterministic=values.pop("deterministic") or None,
    )


def engine_extra(engine_args: list[str] | None, extra_json: str | None, **named: Any) -> dict[str, Any]:
    """Merge --extra-engine-args JSON, then --engine-arg KEY=VALUE, then named flags that were given."""
    extra: dict[str, Any] = {}
    if extra_json:
        try:
            loaded = json.loads(extra_json)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--extra-engine-args is not valid JSON: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError("--extra-engine-args must be a JSON object")
        extra.update(loaded)
    for item in engine_args or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--engine-arg '{item}' must look like KEY=VALUE")
        try:
            extra[key.replace("-", "_")] = json.loads(raw)
        except json.JSONDecodeError:
            extra[key.replace("-", "_")] = raw
    extra.update({k: v for k, v in named.items() if v is not None})
    return extra


def planner_option(flag: str, help: str, *, prefix: str = "") -> Any:
    """A planner option with its DYN_PLANNER_* twin: `--FLAG` on `dyn plan run`, `--planner-FLAG` on `dyn serve`
    (prefix "planner-"), one environment variable for both."""
    name = flag.strip("-")
    panel = "Planner (scales the workers to TTFT/ITL targets)" if prefix else None
    envvar = "DYN_PLANNER_" + name.upper().replace("-", "_")
    return typer.Option(f"--{prefix}{name}", envvar=envvar, help=help, rich_help_panel=panel)


##### API keys (AuthConfig.api_keys) #####

API_KEY_OPTIONS = [
    settings.option(
        "api_key",
        Annotated[
            list[str] | None,
            typer.Option(
                "--api-key",
                help="Accepted API key (repeatable); else DYN_API_KEYS (comma-separated).",
                rich_help_panel=SECURITY,
            ),
        ],
        None,
    ),
    settings.option(
        "api_key_file",
        Annotated[
            str | None,
            typer.Option(
                "--api-key-file",
                envvar="DYN_API_KEY_FILE",
                help="File of API keys, one a line.",
                rich_help_panel=SECURITY,
            ),
        ],
        None,
    ),
]


##### The cluster secret (request-plane authentication) #####

ClusterSecretFile = Annotated[
    Path | None,
    typer.Option(
        "--cluster-secret-file",
        envvar="DYN_CLUSTER_SECRET_FILE",
        rich_help_panel=SECURITY,
        help="File (mode 600) holding the request plane's shared secret in hex, the same on every node"
        " (make one: openssl rand -hex 32). Default: DYN_CLUSTER_SECRET; without either, `dyn serve` makes one"
        " and `dyn worker`/`dyn router` listen on loopback only.",
    ),
]


def cluster_secret(path: Path | None, *, make: bool = False) -> bytes | None:
    """The cluster secret: `--cluster-secret-file`, else DYN_CLUSTER_SECRET (hex), else a new random one
    if `make` (`dyn serve`: one per deployment), else None (the request plane then stays on loopback)."""
    if path is not None:
        return _parse_secret(_read_private(path), f"--cluster-secret-file {path}")
    text = os.environ.get(CLUSTER_SECRET_ENV, "").strip()
    if text:
        return _parse_secret(text, CLUSTER_SECRET_ENV)
    return new_secret() if make else None


def _read_private(path: Path) -> str:
    """The file's text; ConfigError if it is unreadable or other users may read it (as ssh does with keys)."""
    try:
        mode = path.stat().st_mode
        text = path.read_text(errors="replace")
    except OSError as exc:
        raise ConfigError(f"--cluster-secret-file {path} cannot be read: {exc.strerror or exc}") from None
    if mode & 0o077:
        raise ConfigError(
            f"--cluster-secret-file {path} is open to other users (mode {mode & 0o777:o}); run: chmod 600 {path}"
        )
    return text


def _parse_secret(text: str, source: str) -> bytes:
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise ConfigError(f"the cluster secret from {source} is not hex; make one with: openssl rand -hex 32") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the cluster secret from {source} has {len(secret)} bytes, fewer than"
            f" {MIN_SECRET_BYTES}; make one with: openssl rand -hex 32"
        )
    return secret
