"""The mocker's part in disaggregation: what a request's KV handle asks of it, and what its prefill hands on.

Two ways to hand the KV on, picked by the engine option `kv_transfer_mode`:
- "pull" (the default; llama.cpp and vLLM move KV this way): a prefill computes the prompt, samples the
  first token and ends with a MockerKv (`nbytes` = prompt x `kv_bytes_per_token`) that its worker holds
  until the decode worker pulls it; the decode request is prompt + [first_token].
- "rendezvous" (SGLang's way): a prefill-role mocker publishes a bootstrap address (`EngineInfo.extra
  ["bootstrap"]`), so the frontend makes an SglangKv up front and sends the bare prompt with it to the
  prefill and the decode worker at once. The prefill computes the prompt and ends with no token and the
  same handle; the decode emits every token, the first included.

NOTE: the mocker models the meeting, not a bootstrap server: nothing listens at the published address,
and a decode mocker cannot see its prefill (another process). It waits what the meeting costs at least:
the prompt's prefill by the timing model (as if nothing were cached or queued on the prefill worker)
plus the transfer (bytes / bandwidth); then it allocates the prompt's blocks without computing them.
A decode or both-role mocker takes either kind of handle, whatever its own mode.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynamo_cli.engine import Role
from dynamo_cli.errors import RequestError
from dynamo_cli.kv.handles import UNKNOWN_FIRST_TOKEN, MockerKv, SglangKv
from dynamo_cli.timing import TimingModel
from dynamo_cli.wire import GenerateRequest

from .config import MockerConfig
from .scheduler import MockRequest

BOOTSTRAP_PORT = 8998
"""SGLang's default bootstrap port: the port of the address a rendezvous prefill publishes (unserved)."""


@dataclass(frozen=True, slots=True)
class Handoff:
    """How the engine runs one request, read from its handle."""

    is_prefilled: bool = False
    """The prompt's KV came from a prefill worker: its blocks are allocated, not computed."""
    wait_s: float = 0.0
    """Simulated time before the request is queued: the transfer (and a rendezvous's prefill)."""
    rendezvous: SglangKv | None = None
    """A rendezvous prefill: emit no token and end with this handle."""


def bootstrap_address(config: MockerConfig) -> str | None:
    """This engine's `EngineInfo.extra["bootstrap"]`: set for a prefill-role mocker in rendezvous mode."""
    if config.role is not Role.PREFILL or config.kv_transfer_mode != "rendezvous":
        return None
    return f"{config.host}:{BOOTSTRAP_PORT}"


def read_handle(config: MockerConfig, timing: TimingModel, request: GenerateRequest) -> Handoff:
    """What the request's handle asks; RequestError (param kv_transfer) for a handle this engine cannot take."""
    handle, num_request = request.kv_transfer, len(request.token_ids)
    if config.role is Role.PREFILL:
        return _read_prefill_handle(config, request)
    if handle is None:
        return Handoff()
    if isinstance(handle, MockerKv):
        if handle.num_tokens != num_request - 1 or handle.first_token != request.token_ids[-1]:
            raise RequestError(
                f"kv_transfer covers {handle.num_tokens} tokens (first token {handle.first_token}) of a "
                f"{num_request}-token request; send prompt + [first_token] with num_tokens = len(prompt)",
                "kv_transfer",
            )
        return Handoff(is_prefilled=True, wait_s=config.transfer_delay_s(handle.nbytes))
    if isinstance(handle, SglangKv):
        if handle.first_token != UNKNOWN_FIRST_TOKEN or handle.num_tokens != num_request:
            raise RequestError(
                f"kv_transfer (SglangKv) covers {handle.num_tokens} tokens (first token {handle.first_token}) of "
                f"a {num_request}-token request; a rendezvous sends the bare prompt with num_tokens = len(prompt) "
                f"and first_token {UNKNOWN_FIRST_TOKEN}",
                "kv_transfer",
            )
        transfer_s = config.transfer_delay_s(handle.num_tokens * config.kv_bytes_per_token)
        return Handoff(is_prefilled=True, wait_s=prefill_s(config, timing, handle.num_tokens) + transfer_s)
    kind = type(handle).__name__
    raise RequestError(f"kv_transfer is a {kind}; the mocker takes MockerKv or SglangKv only", "kv_transfer")


def prefill_s(config: MockerConfig, timing: TimingModel, num_tokens: int) -> float:
    """Simulated time of a prefill of `num_tokens` uncached tokens alone, in passes of the token budget."""
    budget, total_ms = config.max_num_batched_tokens, 0.0
    for start in range(0, num_tokens, budget):
        total_ms += timing.pass_ms(min(budget, num_tokens - start), 0, 0.0)
    return total_ms / 1000.0


def pulled_handle(config: MockerConfig, request: MockRequest) -> MockerKv:
    """What a pull-mode prefill ends with: its first token and the size of the prompt's KV."""
    num_tokens = request.prompt_len
    return MockerKv(
        num_tokens=num_tokens,
        first_token=request.token_ids[num_tokens],
        nbytes=num_tokens * config.kv_bytes_per_token,
    )


def _read_prefill_handle(config: MockerConfig, request: GenerateRequest) -> Handoff:
    handle = request.kv_transfer
    if config.kv_transfer_mode == "pull":
        if handle is not None:
            raise RequestError("a prefill-role worker takes no kv_transfer; send it to a decode worker", "kv_transfer")
        return Handoff()
    if not isinstance(handle, SglangKv) or handle.first_token != UNKNOWN_FIRST_TOKEN:
        raise RequestError(
            "a rendezvous prefill (kv_transfer_mode=rendezvous) needs kv_transfer: the SglangKv the frontend "
            f"made for this request, with first_token {UNKNOWN_FIRST_TOKEN}; got {_kind(handle)}",
            "kv_transfer",
        )
    if handle.num_tokens != len(request.token_ids):
        raise RequestError(
            f"kv_transfer (SglangKv) covers {handle.num_tokens} tokens of a {len(request.token_ids)}-token "
            "prompt; a rendezvous sends the bare prompt with num_tokens = len(prompt)",
            "kv_transfer",
        )
    return Handoff(rendezvous=handle)


def _kind(handle: object) -> str:
    return "none" if handle is None else type(handle).__name__
