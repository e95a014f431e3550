"""One `dyn bench` invocation: check the endpoint, build the workload, run each load, summarise.

The CLI builds a `BenchConfig` and calls `run_bench`; everything here is testable without a terminal.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dynamo_cli.bench import workload as wl
from dynamo_cli.bench.agents import AgentConfig, CallFigures, agent_sessions, call_figures
from dynamo_cli.bench.http import EndpointError, EndpointUnreachable, Headers, HttpClient, RequestRecord
from dynamo_cli.bench.load import SEED, Endpoint, LoadConfig, LoadRunner, RequestBuilder, parse_model_mix
from dynamo_cli.bench.metrics import RequestMetrics, Slo, Summary, parse_slo, request_metrics, summarize
from dynamo_cli.bench.tenants import (
    TenantFigures,
    TenantLoad,
    as_tenant,
    parse_tenants,
    run_tenants,
    tenant_connections,
    tenant_figures,
)
from dynamo_cli.errors import ConfigError, ModelNotFound
from dynamo_cli.settings import setting

_UNBOUNDED_CONNECTIONS = 4096
_WARMUP_OFFSET = 1_000_003
"""Seed offset of the warm-up's prompts, so that none is one of the measured ones."""
_TENANT_OFFSET = 2_000_003
"""Seed offset between tenants' prompts."""


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Which prompts to send (the first of trace, prompts_file, shared prefix, synthetic that is set)."""

    isl: float = setting(512, "--isl", env=None)
    """Mean input tokens (synthetic prompts)."""
    isl_stddev: float = setting(0, "--isl-stddev", env=None)
    """Input tokens' standard deviation."""
    osl: float = setting(128, "--osl", env=None)
    """Mean output tokens (max_tokens; with --ignore-eos, the output length)."""
    osl_stddev: float = setting(0, "--osl-stddev", env=None)
    """Output tokens' standard deviation."""
    turns: int = setting(1, "--turns", env=None)
    """User turns per session (multi-turn when > 1)."""
    num_prefixes: int = setting(0, "--num-prefixes", env=None)
    """Shared-prefix workload: number of distinct prefixes (0: off)."""
    prefix_len: int = setting(0, "--prefix-len", env=None)
    """Shared-prefix workload: tokens per prefix."""
    suffix_len: int = setting(0, "--suffix-len", env=None)
    """Shared-prefix workload: unique tokens after it (default: --isl)."""
    trace: str | None = setting(None, "--trace", env=None)
    """Mooncake JSONL trace to replay (timestamps in ms)."""
    trace_time_scale: float = setting(1.0, "--trace-time-scale", env=None)
    """Send time = timestamp × this (0.5 = twice as fast)."""
    trace_block_size: int = setting(512, "--trace-block-size", env=None)
    """Tokens per trace hash id."""
    prompts_file: str | None = setting(None, "--prompts-file", env=None)
    """Prompts, one per line or JSONL with "text"."""
    images_per_request: int = setting(0, "--images-per-request", env=None)
    """Images sent with each user turn, after its text (chat only; 0: text only)."""
    image_size: int = setting(256, "--image-size", env=None)
    """Side in pixels of each (random, square, PNG) image."""
    image_repeat: float = setting(0.0, "--image-repeat", env=None)
    """Share of images that repeat one of --image-pool images (the rest are new): what image-aware routing and
    embedding caches can reuse."""
    image_pool: int = setting(20, "--image-pool", env=None)
    """Distinct repeated images."""
    seed: int = setting(0, SEED)
    """Seeds every random choice, so a run is reproducible."""
    agent: AgentConfig = field(default_factory=AgentConfig)

    def __post_init__(self) -> None:
        if self.images_per_request < 0 or not 8 <= self.image_size <= 4096 or self.image_pool < 1:
            raise ConfigError("--images-per-request must be >= 0, --image-size 8..4096, --image-pool >= 1")
        if not 0.0 <= self.image_repeat <= 1.0:
            raise ConfigError(f"--image-repeat is a share, 0..1; got {self.image_repeat}")
        others = {"--turns": self.turns > 1, "--num-prefixes": self.num_prefixes > 0, "--trace": self.trace}
        others["--prompts-file"] = self.prompts_file
        given = [flag for flag, value in others.items() if value]
        if self.agent.sessions and given:
            raise ConfigError(f"--agent-sessions builds its own prompts; drop {', '.join(given)}")


def parse_sweep(spec: str | None) -> tuple[str, tuple[float, ...]] | None:
    """`concurrency=1,2,4` or `request_rate=5,10` → (parameter, values)."""
    if not spec:
        return None
    name, _, values = spec.partition("=")
    name = name.strip().replace("-", "_")
    if name not in ("concurrency", "request_rate") or not values:
        raise ConfigError(f"--sweep {spec!r}: expected concurrency=1,2,4 or request_rate=5,10")
    try:
        numbers = tuple(float(v) for v in values.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"--sweep {spec!r}: the values must be numbers") from None
    return name, numbers


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """Everything one benchmark run needs."""

    url: str = setting("http://127.0.0.1:8000", "--url", env="DYN_BENCH_URL")
    """Server base URL, http://host:port."""
    load: LoadConfig
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    model: str | None = setting(None, "--model", env="DYN_BENCH_MODEL")
    """Model name (with --model-mix: names, comma-separated); default: the first of GET /v1/models."""
    model_mix: str | None = setting(None, "--model-mix", env=None)
    """uniform or zipf:S: each conversation asks one of the --model names (LoRA tenants: zipf:1.1)."""
    endpoint: Endpoint = setting("chat", "--endpoint", env=None, cli_type=str)
    """chat (/v1/chat/completions) | completions (/v1/completions)."""
    tokenizer: str | None = setting(None, "--tokenizer", env="DYN_BENCH_TOKENIZER")
    """Tokenizer alias or path; default: the model name."""
    ignore_eos: bool = setting(True, "--ignore-eos/--no-ignore-eos", env=None)
    """Send ignore_eos/min_tokens so the output length is met."""
    slo: Slo = setting(Slo(), "--slo", env=None, cli_type=list[str] | None, parse=parse_slo, show=lambda _: None)
    """Goodput SLOs in ms, e.g. --slo 'ttft=200 itl=25 e2e=2000' (repeatable)."""
    request_timeout: float = setting(600.0, "--timeout", env=None)
    """Per-request timeout in seconds."""
    sweep: tuple[str, tuple[float, ...]] | None = setting(
        None, "--sweep", env=None, cli_type=str | None, parse=parse_sweep
    )
    """Run once per value: concurrency=1,2,4 or request_rate=5,10."""
    api_key: str | None = setting(None, "--api-key", env="DYN_BENCH_API_KEY", repr=False)
    """Key of a frontend started with --api-key (sent as `Authorization: Bearer KEY`; never reported)."""
    tenants: tuple[TenantLoad, ...] = setting(
        (), "--tenant", env=None, cli_type=list[str] | None, parse=parse_tenants, show=lambda _: None
    )
    """Multi-tenant workload, one --tenant per tenant, all sending at once (--num-requests and --warmup: per
    tenant): name=N[,isl=,osl=][,rate=R|concurrency=C][,weight=W][,class=system|interactive|default|bulk][,key=K]."""

    def __post_init__(self) -> None:
        if self.endpoint not in ("chat", "completions"):
            raise ConfigError(f"--endpoint must be chat or completions, got {self.endpoint}")
        if self.workload.images_per_request and self.endpoint != "chat":
            raise ConfigError("--images-per-request needs --endpoint chat (completions take no images)")
        load, agents = self.load, self.workload.agent.sessions > 0
        if agents and (self.tenants or self.sweep or load.concurrency or load.request_rate):
            raise ConfigError(
                "--agent-sessions sets the load (its sessions at once); drop --tenant, --sweep, --concurrency "
                "and --request-rate"
            )
        if self.tenants and (self.sweep or self.workload.trace):
            raise ConfigError("--tenant sets each tenant's load; drop --sweep and --trace")


@dataclass(frozen=True, slots=True)
class RunResult:
    """One load's outcome."""

    label: str
    summary: Summary
    metrics: list[RequestMetrics]
    chunk_times: list[list[float]]
    calls: list[CallFigures] = field(default_factory=list)
    """Agentic workload: the figures of call 1 and of calls 2..N."""
    tenants: list[TenantFigures] = field(default_factory=list)
    """Multi-tenant workload: each tenant's figures."""


@dataclass(frozen=True, slots=True)
class BenchResult:
    """Every load's outcome plus what the run was (for the report header and JSON `info`)."""

    runs: list[RunResult]
    info: dict[str, Any]


OnRecord = Callable[[RequestRecord], None]
OnPhase = Callable[[str, LoadConfig], None]


async def resolve_model(client: HttpClient, model: str | None, headers: Headers = ()) -> str:
    """Check `model` against GET /v1/models, or pick the first one listed."""
    try:
        listing = await client.get_json("/v1/models", headers)
    except EndpointError:
        if model:
            return model  # no /v1/models here: trust the flag
        raise ConfigError(f"{client.url} lists no models (GET /v1/models failed); pass --model") from None
    known = [str(m.get("id")) for m in listing.get("data", []) if isinstance(m, dict)]
    if model is None:
        if not known:
            raise ConfigError(f"{client.url} serves no model yet (GET /v1/models is empty); pass --model")
        return known[0]
    if known and model not in known:
        raise ModelNotFound(model, known)
    return model


async def probe(client: HttpClient, builder: RequestBuilder, headers: Headers = ()) -> None:
    """Send one tiny request so a wrong model or a non-streaming server fails fast, with its reason."""
    record = await client.stream(builder.path, builder.body([], wl.Turn(" hello", 1, 2)), headers=headers)
    if record.error is None:
        return
    if record.status == 0:
        raise EndpointUnreachable(client.url, record.error)
    raise EndpointError(f"{client.url}{builder.path} failed a test request: {record.error}")


def build_workload(w: WorkloadConfig, vocab: wl.Vocab, seed_offset: int = 0) -> Iterator[wl.Conversation]:
    """The conversations `w` describes (the warm-up's: another `seed_offset`, so that none repeats a measured one)."""
    conversations = _text_workload(w, vocab, seed_offset)
    if not w.images_per_request:
        return conversations
    images = wl.ImageMaker(w.image_size, w.image_repeat, w.image_pool, w.seed + seed_offset)
    return wl.with_images(conversations, images, w.images_per_request)


def _text_workload(w: WorkloadConfig, vocab: wl.Vocab, seed_offset: int) -> Iterator[wl.Conversation]:
    seed = w.seed + seed_offset
    if w.agent.sessions:
        return agent_sessions(vocab, w.agent, w.osl, w.osl_stddev, w.seed, offset=seed_offset)
    if w.trace:
        return wl.trace_replay(vocab, wl.read_trace(w.trace), w.trace_time_scale, w.trace_block_size, seed)
    if w.prompts_file:
        return wl.prompts_file(w.prompts_file, w.osl, w.osl_stddev, vocab, seed)
    if w.num_prefixes > 0:
        suffix = w.suffix_len or int(w.isl)
        return wl.shared_prefix(vocab, w.num_prefixes, w.prefix_len, suffix, w.osl, w.osl_stddev, seed)
    return wl.synthetic(vocab, w.isl, w.isl_stddev, w.osl, w.osl_stddev, w.turns, seed, offset=seed_offset)


def _loads(config: BenchConfig) -> list[tuple[str, LoadConfig]]:
    agent = config.workload.agent
    if agent.sessions:  # one slot per session, each started in turn over the ramp-up (default: one mean gap)
        ramp_up_s = config.load.ramp_up_s or agent.tool_gap.mean
        return [("", dataclasses.replace(config.load, concurrency=agent.sessions, ramp_up_s=ramp_up_s))]
    if config.sweep is None:
        return [("", config.load)]
    name, values = config.sweep
    loads = []
    for value in values:
        if name == "concurrency":
            load = dataclasses.replace(config.load, concurrency=int(value))
        else:
            load = dataclasses.replace(config.load, request_rate=value)
        loads.append((f"{value:g}", load))
    return loads


def _connections(config: BenchConfig, loads: list[tuple[str, LoadConfig]]) -> int:
    if config.tenants:
        return tenant_connections(config.tenants, config.load, _UNBOUNDED_CONNECTIONS)
    is_open = config.workload.trace is not None or any(c.request_rate is not None for _, c in loads)
    return max(c.concurrency or (_UNBOUNDED_CONNECTIONS if is_open else 1) for _, c in loads)


async def _builder(client: HttpClient, config: BenchConfig, headers: Headers) -> tuple[RequestBuilder, str]:
    """The request builder of the run's model (or models), checked against the server; and what to report."""
    if config.model_mix is None:
        model = await resolve_model(client, config.model, headers)
        return RequestBuilder(model, config.endpoint, config.ignore_eos), model
    names = [name.strip() for name in (config.model or "").split(",") if name.strip()]
    if not names:
        raise ConfigError("--model-mix needs --model NAME,NAME,... (the models to mix)")
    models = [await resolve_model(client, name, headers) for name in names]
    mix = parse_model_mix(models, config.model_mix, config.load.seed)
    return RequestBuilder(models[0], config.endpoint, config.ignore_eos, mix=mix), ",".join(models)


async def run_bench(
    config: BenchConfig, on_record: OnRecord | None = None, on_phase: OnPhase | None = None
) -> BenchResult:
    """Check the endpoint, then run every load (one, or one per sweep value) and summarise each."""
    loads = _loads(config)
    auth = {"authorization": f"Bearer {config.api_key}"} if config.api_key else None
    headers = config.tenants[0].headers() if config.tenants else ()  # a tenant's own key may be the only one
    async with HttpClient(
        config.url, max_connections=_connections(config, loads), request_timeout=config.request_timeout, headers=auth
    ) as client:
        builder, model = await _builder(client, config, headers)
        await probe(client, builder, headers)
        vocab = wl.load_vocab(config.tokenizer or builder.model)
        runs = []
        for label, load in loads:
            if on_phase is not None:
                on_phase(label, _shown_load(config, load))
            records = await _measure(client, builder, config, load, vocab, on_record)
            runs.append(_result(label, records, vocab, config))
    return BenchResult(runs, _info(config, model, vocab))


def _shown_load(config: BenchConfig, load: LoadConfig) -> LoadConfig:
    """The load as the progress bar counts it: every tenant's requests."""
    if load.num_requests is None:
        return load
    if config.tenants:
        return dataclasses.replace(load, num_requests=load.num_requests * len(config.tenants))
    return load


async def _measure(
    client: HttpClient,
    builder: RequestBuilder,
    config: BenchConfig,
    load: LoadConfig,
    vocab: wl.Vocab,
    on_record: OnRecord | None,
) -> list[RequestRecord]:
    w = config.workload
    if not config.tenants:
        measured, warmup = build_workload(w, vocab), build_workload(w, vocab, seed_offset=_WARMUP_OFFSET)
        return await LoadRunner(client, builder, on_record).run(load, measured, warmup, is_replay=w.trace is not None)

    def workloads(index: int, tenant: TenantLoad) -> tuple[Iterator[wl.Conversation], Iterator[wl.Conversation]]:
        mine = dataclasses.replace(w, isl=tenant.isl or w.isl, osl=tenant.osl or w.osl)
        offset = (index + 1) * _TENANT_OFFSET
        measured = build_workload(mine, vocab, seed_offset=offset)
        return as_tenant(tenant, measured), as_tenant(tenant, build_workload(mine, vocab, offset + _WARMUP_OFFSET))

    return await run_tenants(client, builder, config.tenants, load, workloads, on_record)


def _info(config: BenchConfig, model: str, vocab: wl.Vocab) -> dict[str, Any]:
    return {
        "url": config.url,
        "model": model,
        "endpoint": config.endpoint,
        "tokenizer": vocab.source,
        "is_tokenizer_exact": vocab.is_exact,
        "ignore_eos": config.ignore_eos,
        "time": time.time(),
        "load": dataclasses.asdict(config.load),
        "workload": {**dataclasses.asdict(config.workload), "agent": _agent_info(config.workload.agent)},
        "sweep": list(config.sweep) if config.sweep else None,
        "tenants": [t.public() for t in config.tenants] or None,
    }


def _agent_info(agent: AgentConfig) -> dict[str, Any]:
    return {**dataclasses.asdict(agent), "tool_gap": str(agent.tool_gap)}


def _result(label: str, records: list[RequestRecord], vocab: wl.Vocab, config: BenchConfig) -> RunResult:
    metrics = [request_metrics(r, vocab.count_tokens) for r in records]
    fallback = "tokenizer" if vocab.is_exact else "approximate word count"
    summary = summarize(metrics, config.slo, fallback)
    agent = config.workload.agent
    return RunResult(
        label,
        summary,
        metrics,
        [list(r.chunk_times) for r in records],
        calls=call_figures(metrics, agent.calls) if agent.sessions else [],
        tenants=tenant_figures(metrics, config.tenants, summary.duration_s) if config.tenants else [],
    )
