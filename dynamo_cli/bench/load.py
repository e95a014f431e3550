"""Load generation: send a workload's conversations at a fixed concurrency, a request rate or a trace's times.

NOTE: the three modes differ only in *when* a conversation starts. Concurrency N runs N slots that each
start the next conversation when their last one ends (closed loop). A request rate starts conversations
at constant or exponential (Poisson) gaps, optionally capped at N in flight (open loop; a capped request
waits for a slot, and its send time is recorded). A trace starts each at its own `at`. Turns of one
conversation always run one after the other. The run stops issuing at `num_requests` or `duration_s`
and then waits for what is in flight; warm-up requests run first and are not returned.
"""

from __future__ import annotations

import asyncio
import random
import time
import zlib
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from dynamo_cli.bench.http import HttpClient, RequestRecord
from dynamo_cli.bench.workload import Conversation, Turn
from dynamo_cli.errors import ConfigError
from dynamo_cli.settings import Setting, setting

SEED = Setting(("--seed",), None, "Seed of every random choice (prompts, lengths, gaps): a run is reproducible.")
"""One `--seed` for the load's gaps and the workload's prompts."""

Endpoint = Literal["chat", "completions"]


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """How many requests, how fast."""

    concurrency: int | None = setting(None, "--concurrency", "-c", env=None)
    """Requests in flight (closed loop); with --request-rate, a cap."""
    request_rate: float | None = setting(None, "--request-rate", env=None)
    """Requests per second (open loop)."""
    arrival: Literal["constant", "poisson"] = setting("constant", "--arrival", env=None, cli_type=str)
    """Gaps between request starts in rate mode: constant | poisson."""
    num_requests: int | None = setting(None, "--num-requests", "-n", env=None)
    """Measured requests (default: 100 without --duration; a whole --trace)."""
    duration_s: float | None = setting(None, "--duration", env=None)
    """Stop issuing after this many seconds."""
    warmup: int = setting(0, "--warmup", env=None)
    """Warm-up requests, sent first and excluded from the figures."""
    seed: int = setting(0, SEED)
    """Seeds the Poisson gaps."""
    ramp_up_s: float = setting(0.0, "--ramp-up", env=None)
    """Closed loop: start the --concurrency streams evenly over this many seconds (0: at once).

    A closed loop at fixed output lengths keeps the start pattern: streams started together finish together and
    come back together (prefill waves), streams started apart stay apart, so two systems compared must start
    alike."""

    def __post_init__(self) -> None:
        if self.ramp_up_s < 0:
            raise ConfigError(f"--ramp-up ({self.ramp_up_s}) must be ≥ 0")
        if self.concurrency is not None and self.concurrency < 1:
            raise ConfigError(f"--concurrency ({self.concurrency}) must be ≥ 1")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ConfigError(f"--request-rate ({self.request_rate}) must be > 0")
        if self.arrival not in ("constant", "poisson"):
            raise ConfigError(f"--arrival must be constant or poisson, got {self.arrival}")
        if self.num_requests is None and self.duration_s is None:
            raise ConfigError("give --num-requests or --duration")


@dataclass(frozen=True, slots=True)
class ModelMix:
    """Several models (LoRA adapters, typically) and how often each is asked for."""

    models: tuple[str, ...]
    weights: tuple[float, ...]
    seed: int = 0

    def pick(self, key: str) -> str:
        """The model of the conversation that opened with `key` (the same for each of its turns)."""
        draw = random.Random(zlib.crc32(key.encode()) ^ self.seed).random() * sum(self.weights)
        for model, weight in zip(self.models, self.weights, strict=True):
            draw -= weight
            if draw < 0:
                return model
        return self.models[-1]


def parse_model_mix(models: list[str], spec: str, seed: int = 0) -> ModelMix:
    """`--model-mix uniform` or `zipf:S` over `models` (the i-th weighted 1 / (i + 1)^S); ConfigError otherwise."""
    kind, _, value = spec.partition(":")
    if kind == "uniform" and not value:
        return ModelMix(tuple(models), (1.0,) * len(models), seed)
    try:
        exponent = float(value) if kind == "zipf" else float("nan")
    except ValueError:
        exponent = float("nan")
    if not exponent >= 0:
        raise ConfigError(f"--model-mix {spec!r} is invalid; use uniform or zipf:S with S >= 0 (zipf:1.1)")
    return ModelMix(tuple(models), tuple(1 / (i + 1) ** exponent for i in range(len(models))), seed)


@dataclass(frozen=True, slots=True)
class RequestBuilder:
    """Turns a conversation's history into an OpenAI request body."""

    model: str
    endpoint: Endpoint = "chat"
    ignore_eos: bool = True
    extra: tuple[tuple[str, Any], ...] = ()
    mix: ModelMix | None = None
    """Several models: each conversation asks one of them (`model` is then only the first)."""

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def body(self, history: list[dict[str, str]], turn: Turn) -> dict[str, Any]:
        model = self.model if self.mix is None else self.mix.pick(history[0]["content"] if history else turn.text)
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": turn.output_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            body["messages"] = [*history, {"role": "user", "content": _content(turn)}]
        else:
            body["prompt"] = "".join(m["content"] for m in history) + turn.text
        if self.ignore_eos:
            body["ignore_eos"] = True
            body["min_tokens"] = turn.output_tokens
        body.update(self.extra)
        if turn.extra:
            body.update(turn.extra)
        return body


def opening(conversation: Conversation) -> list[dict[str, str]]:
    """The history a conversation's first turn is sent with: its system prompt, if it has one."""
    return [{"role": "system", "content": conversation.system}] if conversation.system else []


def extended(history: list[dict[str, str]], turn: Turn, reply: str) -> list[dict[str, str]]:
    """The history the turn after `turn` is sent with: `history`, `turn` and the answer to it, appended (so each
    request's prompt starts with the previous one's)."""
    return [*history, {"role": "user", "content": turn.text}, {"role": "assistant", "content": reply}]


def _content(turn: Turn) -> str | list[dict[str, Any]]:
    """A user turn's chat content: its text, then its images as image_url parts."""
    if not turn.images:
        return turn.text
    return [{"type": "text", "text": turn.text}] + [{"type": "image_url", "image_url": {"url": u}} for u in turn.images]


OnRecord = Callable[[RequestRecord], None]


class LoadRunner:
    """Runs one load phase; `records` holds every finished request in completion order."""

    def __init__(self, client: HttpClient, builder: RequestBuilder, on_record: OnRecord | None = None) -> None:
        self.client = client
        self.builder = builder
        self.on_record = on_record
        self.records: list[RequestRecord] = []
        self._issued = 0
        self._limit: int | None = None
        self._stop_at = float("inf")

    async def run(
        self,
        config: LoadConfig,
        conversations: Iterator[Conversation],
        warmup: Iterator[Conversation] | None = None,
        is_replay: bool = False,
    ) -> list[RequestRecord]:
        """Warm up (if asked), then run the measured phase and return its records.

        With `is_replay`, each conversation starts at its `at` seconds after the phase starts (trace
        replay), capped at `config.concurrency` in flight when set.
        """
        if config.warmup > 0:
            warm = LoadRunner(self.client, self.builder)
            slots = min(config.concurrency or 1, config.warmup)
            await warm._closed_loop(slots, warmup or conversations, config.warmup, float("inf"))
        self.records = []
        self._issued = 0
        stop_at = time.perf_counter() + config.duration_s if config.duration_s else float("inf")
        if is_replay:
            await self._open_loop(config, conversations, stop_at, is_replay=True)
        elif config.request_rate is None:
            slots = config.concurrency or 1
            await self._closed_loop(slots, conversations, config.num_requests, stop_at, config.ramp_up_s)
        else:
            await self._open_loop(config, conversations, stop_at)
        return self.records

    ##### phases #####

    async def _closed_loop(
        self,
        slots: int,
        conversations: Iterator[Conversation],
        limit: int | None,
        stop_at: float,
        ramp_up_s: float = 0.0,
    ) -> None:
        self._limit, self._stop_at = limit, stop_at
        start = time.perf_counter()

        async def slot(number: int) -> None:
            await _sleep_until(start + ramp_up_s * number / slots)
            for conversation in conversations:
                if self._is_exhausted():
                    return
                await self._conversation(conversation, None)

        async with asyncio.TaskGroup() as group:
            for number in range(slots):
                group.create_task(slot(number))

    async def _open_loop(
        self,
        config: LoadConfig,
        conversations: Iterator[Conversation],
        stop_at: float,
        is_replay: bool = False,
    ) -> None:
        self._limit, self._stop_at = config.num_requests, stop_at
        rate = config.request_rate or 1.0
        rng = random.Random(config.seed)
        cap = asyncio.Semaphore(config.concurrency) if config.concurrency else None
        start = next_at = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for conversation in conversations:
                if is_replay:
                    next_at = start + (conversation.at or 0.0)
                await _sleep_until(next_at)
                if self._is_exhausted():
                    break
                self._issued += 1  # reserve now, so the loop never schedules past the limit
                group.create_task(self._capped(cap, conversation, next_at, reserved=True))
                next_at += rng.expovariate(rate) if config.arrival == "poisson" else 1.0 / rate

    ##### one conversation #####

    async def _capped(
        self, cap: asyncio.Semaphore | None, conversation: Conversation, at: float, reserved: bool = False
    ) -> None:
        if cap is None:
            await self._conversation(conversation, at, reserved)
            return
        async with cap:
            await self._conversation(conversation, at, reserved)

    async def _conversation(self, conversation: Conversation, at: float | None, reserved: bool = False) -> None:
        history = opening(conversation)
        for number, turn in enumerate(conversation.turns):
            if turn.gap_s > 0:
                await _sleep_until(min(time.perf_counter() + turn.gap_s, self._stop_at))
            if not (reserved and number == 0):
                if self._is_exhausted():
                    return
                self._issued += 1
            record = RequestRecord(
                input_tokens=turn.input_tokens,
                scheduled=at if number == 0 else None,
                turn=number,
                tenant=conversation.tenant,
            )
            body = self.builder.body(history, turn)
            await self.client.stream(self.builder.path, body, record, conversation.headers)
            self._finish(record)
            if not record.is_ok:
                return  # a failed turn ends its conversation: later turns would lack their history
            history = extended(history, turn, record.text)

    def _is_exhausted(self) -> bool:
        if self._limit is not None and self._issued >= self._limit:
            return True
        return time.perf_counter() >= self._stop_at

    def _finish(self, record: RequestRecord) -> None:
        self.records.append(record)
        if self.on_record is not None:
            self.on_record(record)


async def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


def run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    """asyncio.run on uvloop when it is installed (lower per-request CPU), else on the default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)
