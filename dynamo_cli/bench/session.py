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
from dynamo_cli.bench.http import EndpointError, EndpointUnreachable, HttpClient, RequestRecord
from dynamo_cli.bench.load import SEED, Endpoint, LoadConfig, LoadRunner, RequestBuilder, parse_model_mix
from dynamo_cli.bench.metrics import RequestMetrics, Slo, Summary, parse_slo, request_metrics, summarize
from dynamo_cli.errors import ConfigError, ModelNotFound
from dynamo_cli.settings import setting

_UNBOUNDED_CONNECTIONS = 4096


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

    def __post_init__(self) -> None:
        if self.images_per_request < 0 or not 8 <= self.image_size <= 4096 or self.image_pool < 1:
            raise ConfigError("--images-per-request must be >= 0, --image-size 8..4096, --image-pool >= 1")
        if not 0.0 <= self.image_repeat <= 1.0:
            raise ConfigError(f"--image-repeat is a share, 0..1; got {self.image_repeat}")


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

    def __post_init__(self) -> None:
        if self.endpoint not in ("chat", "completions"):
            raise ConfigError(f"--endpoint must be chat or completions, got {self.endpoint}")
        if self.workload.images_per_request and self.endpoint != "chat":
            raise ConfigError("--images-per-request needs --endpoint chat (completions take no images)")


@dataclass(frozen=True, slots=True)
class RunResult:
    """One load's outcome."""

    label: str
    summary: Summary
    metrics: list[RequestMetrics]
    chunk_times: list[list[float]]


@dataclass(frozen=True, slots=True)
class BenchResult:
    """Every load's outcome plus what the run was (for the report header and JSON `info`)."""

    runs: list[RunResult]
    info: dict[str, Any]


OnRecord = Callable[[RequestRecord], None]
OnPhase = Callable[[str, LoadConfig], None]


async def resolve_model(client: HttpClient, model: str | None) -> str:
    """Check `model` against GET /v1/models, or pick the first one listed."""
    try:
        listing = await client.get_json("/v1/models")
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


async def probe(client: HttpClient, builder: RequestBuilder) -> None:
    """Send one tiny request so a wrong model or a non-streaming server fails fast, with its reason."""
    record = await client.stream(builder.path, builder.body([], wl.Turn(" hello", 1, 2)))
    if record.error is None:
        return
    if record.status == 0:
        raise EndpointUnreachable(client.url, record.error)
    raise EndpointError(f"{client.url}{builder.path} failed a test request: {record.error}")


def build_workload(config: BenchConfig, vocab: wl.Vocab, seed_offset: int = 0) -> Iterator[wl.Conversation]:
    w = config.workload
    conversations = _text_workload(config, vocab, seed_offset)
    if not w.images_per_request:
        return conversations
    images = wl.ImageMaker(w.image_size, w.image_repeat, w.image_pool, w.seed + seed_offset)
    return wl.with_images(conversations, images, w.images_per_request)


def _text_workload(config: BenchConfig, vocab: wl.Vocab, seed_offset: int) -> Iterator[wl.Conversation]:
    w = config.workload
    seed = w.seed + seed_offset
    if w.trace:
        return wl.trace_replay(vocab, wl.read_trace(w.trace), w.trace_time_scale, w.trace_block_size, seed)
    if w.prompts_file:
        return wl.prompts_file(w.prompts_file, w.osl, w.osl_stddev, vocab, seed)
    if w.num_prefixes > 0:
        suffix = w.suffix_len or int(w.isl)
        return wl.shared_prefix(vocab, w.num_prefixes, w.prefix_len, suffix, w.osl, w.osl_stddev, seed)
    return wl.synthetic(vocab, w.isl, w.isl_stddev, w.osl, w.osl_stddev, w.turns, seed, offset=seed_offset)


def _loads(config: BenchConfig) -> list[tuple[str, LoadConfig]]:
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


async def run_bench(
    config: BenchConfig, on_record: OnRecord | None = None, on_phase: OnPhase | None = None
) -> BenchResult:
    """Check the endpoint, then run every load (one, or one per sweep value) and summarise each."""
    loads = _loads(config)
    is_open = config.workload.trace is not None or any(c.request_rate is not None for _, c in loads)
    most = max(c.concurrency or (_UNBOUNDED_CONNECTIONS if is_open else 1) for _, c in loads)
    auth = {"authorization": f"Bearer {config.api_key}"} if config.api_key else None
    async with HttpClient(
        config.url, max_connections=most, request_timeout=config.request_timeout, headers=auth
    ) as client:
        if config.model_mix is None:
            model = await resolve_model(client, config.model)
            builder = RequestBuilder(model, config.endpoint, config.ignore_eos)
        else:
            names = [name.strip() for name in (config.model or "").split(",") if name.strip()]
            if not names:
                raise ConfigError("--model-mix needs --model NAME,NAME,... (the models to mix)")
            models = [await resolve_model(client, name) for name in names]
            mix = parse_model_mix(models, config.model_mix, config.load.seed)
            model = ",".join(models)
            builder = RequestBuilder(models[0], config.endpoint, config.ignore_eos, mix=mix)
        await probe(client, builder)
        vocab = wl.load_vocab(config.tokenizer or builder.model)
        runs = []
        for label, load in loads:
            if on_phase is not None:
                on_phase(label, load)
            runner = LoadRunner(client, builder, on_record)
            records = await runner.run(
                load,
                build_workload(config, vocab),
                build_workload(config, vocab, seed_offset=1_000_003),
                is_replay=config.workload.trace is not None,
            )
            runs.append(_result(label, records, vocab, config.slo))
    info = {
        "url": config.url,
        "model": model,
        "endpoint": config.endpoint,
        "tokenizer": vocab.source,
        "is_tokenizer_exact": vocab.is_exact,
        "ignore_eos": config.ignore_eos,
        "time": time.time(),
        "load": dataclasses.asdict(config.load),
        "workload": dataclasses.asdict(config.workload),
        "sweep": list(config.sweep) if config.sweep else None,
    }
    return BenchResult(runs, info)


def _result(label: str, records: list[RequestRecord], vocab: wl.Vocab, slo: Slo) -> RunResult:
    metrics = [request_metrics(r, vocab.count_tokens) for r in records]
    fallback = "tokenizer" if vocab.is_exact else "approximate word count"
    return RunResult(label, summarize(metrics, slo, fallback), metrics, [list(r.chunk_times) for r in records])
