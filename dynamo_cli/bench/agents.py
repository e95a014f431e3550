"""The agentic workload of `dyn bench`: sessions whose calls each resend the whole context so far, a tool's time apart.

NOTE: an agent session is one `Conversation` of `calls` turns, so the load runner sends it as it sends any
multi-turn chat: call k's history is every earlier call's text and the model's reply to it, appended (load.py
`extended`), so call k's prompt starts with call k-1's. What makes it an agent is in the turns: a system prompt
of its own, each turn after the first opening with the previous call's synthetic tool output, a tool gap drawn
before each, the session header, and the resume hint. The figures that matter are by call index: call 1 finds
nothing of its session cached, calls 2..N can find everything before their new text.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from dynamo_cli.bench import workload as wl
from dynamo_cli.bench.metrics import RequestMetrics, percentile
from dynamo_cli.errors import ConfigError
from dynamo_cli.settings import setting

SESSION_HEADER = "x-dyn-session-id"
"""The header that names a request's agent session (routing/sessions.py reads it)."""
MAX_RESUME_S = 3600.0
"""The largest `nvext.agent_hints.resume_after_s` a frontend accepts."""
_GAP_FORMS = "use exp:MEAN, const:SECONDS or uniform:LOW:HIGH (seconds, e.g. exp:2.0)"

GapKind = Literal["exp", "const", "uniform"]


@dataclass(frozen=True, slots=True)
class ToolGap:
    """A distribution of tool times in seconds: exponential of mean `low`, constant `low`, or uniform low..high."""

    kind: GapKind
    low: float
    high: float = 0.0

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2 if self.kind == "uniform" else self.low

    def draw(self, rng: random.Random) -> float:
        if self.kind == "exp":
            return rng.expovariate(1 / self.low)
        if self.kind == "uniform":
            return rng.uniform(self.low, self.high)
        return self.low

    def __str__(self) -> str:
        return f"{self.kind}:{self.low:g}" + (f":{self.high:g}" if self.kind == "uniform" else "")


def parse_gap(spec: str) -> ToolGap:
    """`exp:2.0`, `const:1.5` or `uniform:0.5:3` → a ToolGap; ConfigError naming what is wrong otherwise."""
    kind, *values = spec.strip().split(":")
    arity = {"exp": 1, "const": 1, "uniform": 2}.get(kind)
    if arity is None:
        raise ConfigError(f"--agent-tool-gap {spec!r}: unknown distribution {kind!r}; {_GAP_FORMS}")
    if len(values) != arity:
        raise ConfigError(f"--agent-tool-gap {spec!r}: {kind} takes {arity} number(s); {_GAP_FORMS}")
    numbers = []
    for value in values:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and number >= 0):
            raise ConfigError(f"--agent-tool-gap {spec!r}: {value!r} is not a number of seconds >= 0; {_GAP_FORMS}")
        numbers.append(number)
    if kind == "exp" and numbers[0] == 0:
        raise ConfigError(f"--agent-tool-gap {spec!r}: an exponential's mean must be > 0 (const:0 for no gap)")
    if kind == "uniform" and numbers[0] > numbers[1]:
        raise ConfigError(f"--agent-tool-gap {spec!r}: LOW ({values[0]}) is above HIGH ({values[1]})")
    return ToolGap(kind, *numbers)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """The agentic workload: concurrent sessions of calls over a growing context (off while `sessions` is 0)."""

    sessions: int = setting(0, "--agent-sessions", env=None)
    """Agentic workload: concurrent agent sessions, started evenly over --ramp-up (default: one mean tool gap);
    the run ends when all have made their calls (0: off)."""
    calls: int = setting(8, "--agent-calls", env=None)
    """Calls per agent session (output tokens: --osl)."""
    system_len: int = setting(1000, "--agent-system-len", env=None)
    """Tokens of each session's own system prompt."""
    instruction_len: int = setting(20, "--agent-instruction-len", env=None)
    """Tokens of the new instruction each call ends with."""
    tool_len: int = setting(300, "--agent-tool-len", env=None)
    """Tokens of the synthetic tool output each call adds, after the model's reply, to the next call's context."""
    tool_gap: ToolGap = setting(
        ToolGap("exp", 2.0), "--agent-tool-gap", env=None, cli_type=str, parse=parse_gap, show=str
    )
    """Tool time between a reply and the next call: exp:MEAN, const:S or uniform:LOW:HIGH (seconds)."""
    session_header: bool = setting(True, "--agent-session-header/--no-agent-session-header", env=None)
    """Send x-dyn-session-id: SESSION with every call (session affinity)."""
    resume_hint: bool = setting(False, "--agent-resume-hint/--no-agent-resume-hint", env=None)
    """Send nvext.agent_hints.resume_after_s (2 × the mean tool gap) with every call but a session's last."""

    def __post_init__(self) -> None:
        if self.sessions < 0 or self.calls < 1:
            raise ConfigError(f"--agent-sessions ({self.sessions}) must be >= 0 and --agent-calls ({self.calls}) >= 1")
        if self.system_len < 0 or self.tool_len < 0 or self.instruction_len < 1:
            raise ConfigError(
                f"--agent-system-len ({self.system_len}) and --agent-tool-len ({self.tool_len}) must be >= 0, "
                f"--agent-instruction-len ({self.instruction_len}) >= 1"
            )
        if self.resume_hint and not 0 < self.resume_after_s <= MAX_RESUME_S:
            raise ConfigError(
                f"--agent-resume-hint sends 2 × the mean tool gap ({self.resume_after_s:g} s), which must be in "
                f"(0, {MAX_RESUME_S:g}]; change --agent-tool-gap or drop the hint"
            )

    @property
    def resume_after_s(self) -> float:
        """The resume hint: twice the mean tool time, so that most gaps fall within it."""
        return 2 * self.tool_gap.mean


def agent_sessions(
    vocab: wl.Vocab, config: AgentConfig, osl: float, osl_stddev: float, seed: int = 0, offset: int = 0
) -> Iterator[wl.Conversation]:
    """`config.sessions` sessions, each a conversation of `config.calls` calls; session i is `agent-SEED-(offset+i)`,
    and its context opens with a marker of its own, so no two sessions share a prefix."""
    for index in range(offset, offset + config.sessions):
        rng = random.Random(f"agent:{seed}:{index}")
        yield _session(vocab, config, f"agent-{seed}-{index}", wl.marker(vocab, index), rng, osl, osl_stddev)


def _session(
    vocab: wl.Vocab,
    config: AgentConfig,
    name: str,
    head: list[str],
    rng: random.Random,
    osl: float,
    osl_stddev: float,
) -> wl.Conversation:
    pool = wl.WordPool(vocab, rng, size=1 << 12)
    system = "".join((head + pool.take(config.system_len))[: config.system_len]) if config.system_len else None
    turns = []
    tool_output: list[str] = []
    for call in range(config.calls):
        words = tool_output + pool.take(config.instruction_len)
        if system is None and call == 0:
            words = (head + words)[: config.instruction_len]  # no system prompt: the first instruction is marked
        is_last = call == config.calls - 1
        hints = {"nvext": {"agent_hints": {"resume_after_s": config.resume_after_s}}}
        turns.append(
            wl.Turn(
                "".join(words),
                len(words),
                wl.draw_length(rng, osl, osl_stddev),
                gap_s=config.tool_gap.draw(rng) if call else 0.0,
                extra=hints if config.resume_hint and not is_last else None,
            )
        )
        tool_output = pool.take(config.tool_len)
    headers = ((SESSION_HEADER, name),) if config.session_header else ()
    return wl.Conversation(tuple(turns), system=system, headers=headers)


##### figures by call index #####


@dataclass(frozen=True, slots=True)
class CallFigures:
    """The figures of a range of call indexes (call 1, or calls 2..N) over every session; ms and shares."""

    calls: str
    """"1" or "2..N"."""
    num_requests: int
    num_completed: int
    ttft_p50: float
    ttft_p90: float
    prompt_tokens: int
    """Prompt tokens of the completed calls that reported their cached tokens."""
    cached_tokens: int
    cache_hit_rate: float | None
    """cached_tokens / prompt_tokens; None when no call reported its cached tokens."""


def call_figures(metrics: Sequence[RequestMetrics], calls: int) -> list[CallFigures]:
    """Call 1's figures and, when sessions make more than one call, those of calls 2..N together."""
    groups = [("1", [m for m in metrics if m.turn == 0])]
    if calls > 1:
        groups.append((f"2..{calls}", [m for m in metrics if m.turn > 0]))
    return [_figures(label, group) for label, group in groups]


def _figures(label: str, group: Sequence[RequestMetrics]) -> CallFigures:
    ok = [m for m in group if m.is_ok]
    ttfts = sorted(m.ttft for m in ok if m.ttft is not None)
    told = [m for m in ok if m.cached_tokens is not None]
    prompt = sum(m.input_tokens for m in told)
    cached = sum(m.cached_tokens or 0 for m in told)
    return CallFigures(
        calls=label,
        num_requests=len(group),
        num_completed=len(ok),
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        prompt_tokens=prompt,
        cached_tokens=cached,
        cache_hit_rate=cached / prompt if told and prompt > 0 else None,
    )
