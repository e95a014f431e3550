"""What the adapters over engine libraries (vllm, sglang, trtllm) share: role check, model path, request book."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from dynamo_cli.engine import (
    DETERMINISTIC,
    EngineArgs,
    EngineInfo,
    GenerateRequest,
    LoadMetrics,
    Role,
    check_request,
    is_deterministic,
)
from dynamo_cli.errors import ConfigError, DynError


def require_role_both(engine: str, role: Role, why: str = "") -> None:
    """The library adapters serve aggregated requests only; say so for --role prefill|decode."""
    if role is not Role.BOTH:
        reason = f"; {why}" if why else ""
        raise ConfigError(f"the {engine} engine serves --role both only, got {role.value}{reason}")


def split_deterministic(args: EngineArgs) -> tuple[EngineArgs, bool]:
    """Take our `deterministic` key out of the options a library gets verbatim; say whether it was set."""
    if DETERMINISTIC not in args.extra:
        return args, False
    extra = {key: value for key, value in args.extra.items() if key != DETERMINISTIC}
    return replace(args, extra=extra), is_deterministic(args.extra)


def local_or_hub(model: str) -> str:
    """An existing local path, absolute; anything else (a hub name) as given."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else model


@dataclass
class RequestBook:
    """The requests an adapter has in its library, and the prompt tokens it computed or found cached."""

    engine: str
    in_flight: set[str] = field(default_factory=set)
    num_prefill_tokens_computed: int = 0
    num_prefill_tokens_cached: int = 0

    def admit(self, request: GenerateRequest, info: EngineInfo | None, is_running: bool) -> EngineInfo:
        """Check the engine runs and the request fits (RequestError/ContextOverflow for the client)."""
        if info is None or not is_running:
            raise DynError(f"the {self.engine} engine is not running; call start() before generate()")
        check_request(request, info.context_length, self.in_flight, info.vocab_size)
        return info

    def count_prefill(self, request: GenerateRequest, num_cached: int) -> None:
        self.num_prefill_tokens_cached += num_cached
        self.num_prefill_tokens_computed += len(request.token_ids) - num_cached

    def load(self, info: EngineInfo | None) -> LoadMetrics:
        """Requests in flight and prompt-token counters; the library keeps its queue depths to itself."""
        return LoadMetrics(
            num_running=len(self.in_flight),
            total_blocks=info.total_kv_blocks if info else 0,
            num_prefill_tokens_computed=self.num_prefill_tokens_computed,
            num_prefill_tokens_cached=self.num_prefill_tokens_cached,
        )
