"""What the adapters over engine libraries (vllm, sglang, trtllm) share: handle checks, model path, request book."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

from dynamo_cli.engine import DETERMINISTIC, EngineArgs, EngineInfo, check_request, is_deterministic
from dynamo_cli.errors import DynError, RequestError
from dynamo_cli.kv.handles import KvHandle, check_handle
from dynamo_cli.wire import GenerateRequest, LoadMetrics, RankLoad

H = TypeVar("H", bound=KvHandle)


def checked_handle(engine: str, request: GenerateRequest, kind: type[H]) -> H | None:
    """The request's KV handle, if any, once it is known to be this library's and to fit the decode
    convention (token_ids = prompt + [first_token], num_tokens = len(prompt)); else RequestError."""
    handle = request.kv_transfer
    if handle is None:
        return None
    if not isinstance(handle, kind):
        raise RequestError(
            f"kv_transfer is a {type(handle).__name__} handle; the {engine} engine imports only {kind.__name__}",
            param="kv_transfer",
        )
    num_request_tokens = len(request.token_ids)
    problem = check_handle(handle, num_request_tokens)
    if problem is None and handle.num_tokens != num_request_tokens - 1:
        num_prompt = num_request_tokens - 1
        problem = f"kv_transfer covers {handle.num_tokens} tokens; {engine} needs the whole prompt ({num_prompt})"
    if problem is None and request.token_ids[-1] != handle.first_token:
        problem = f"kv_transfer's first token {handle.first_token} is not the request's last token"
    if problem is not None:
        raise RequestError(problem, param="kv_transfer")
    return handle


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, for a library that wants a port number rather than binding port 0
    (vLLM's NIXL side channel, SGLang's bootstrap server); another process may take it first (rare)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


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
        check_request(request, info.context_length, self.in_flight, info.vocab_size, info.images)
        return info

    def count_prefill(self, request: GenerateRequest, num_cached: int) -> None:
        self.num_prefill_tokens_cached += num_cached
        self.num_prefill_tokens_computed += len(request.token_ids) - num_cached

    def load(self, info: EngineInfo | None, num_ranks: int = 1) -> LoadMetrics:
        """Requests in flight and prompt-token counters; the library keeps its queue depths to itself. An engine of
        several data-parallel ranks also reports each rank's share of the KV blocks (the library sizes its ranks
        alike), so routers know each rank's capacity; the counts stay sums only."""
        total = info.total_kv_blocks if info else 0
        shares = [RankLoad(dp_rank=r, total_blocks=total // num_ranks) for r in range(num_ranks)]
        return LoadMetrics(
            num_running=len(self.in_flight),
            total_blocks=total,
            num_prefill_tokens_computed=self.num_prefill_tokens_computed,
            num_prefill_tokens_cached=self.num_prefill_tokens_cached,
            ranks=shares if num_ranks > 1 else [],
        )
