"""The one exception tree of dyn: every error a user can see is a DynError.

DynError
├── ConfigError            bad flag, environment value or model path (CLI exit 2)
├── EngineNotInstalled     an engine plugin whose library is missing (names the pip command)
├── UnknownEngine          --engine NAME not in the registry (lists the known ones)
├── PlaneUnavailable       etcd / NATS / embedded root unreachable at start
│   └── PlaneAuthFailed    etcd / NATS refused our credentials (or we gave none and it wants some)
├── RequestError           a client's mistake, mapped to an OpenAI-style 4xx
│   ├── ModelNotFound      404
│   ├── ContextOverflow    400, says the numbers
│   ├── UnknownInstance    400: a pinned instance id that serves nothing here (lists the known ids)
│   └── RateLimited        429: a key or tenant over a limit the message names (Retry-After)
├── RequestFailed          500: the engine failed this one request; the others go on (not migratable)
├── Overloaded             503: every worker is over its busy threshold
│   └── KvTransferFull     a prefill worker holds as many KV payload bytes as it may (--max bytes)
├── NoWorkers              503: no instance serves the model
├── TransportError         request-plane failures
│   ├── WorkerDisconnected the worker went away mid-stream (migratable)
│   │   └── AuthenticationFailed  the peer failed the request plane's handshake (no shared secret)
│   ├── StreamTimeout      no frame within the idle timeout (migratable)
│   ├── WorkerHung         nothing from the worker for the stall timeout (migratable)
│   └── RemoteError        the worker raised while serving (not migratable)
├── TransferFailed         a KV payload could not be pulled (gone, refused, short, timed out)
│   (defined beside their only raiser:)
├── WorkerFailed           launcher.py: a `dyn serve` worker exited before registering
├── EndpointUnreachable    bench/http.py: the benchmarked URL refuses connections
├── EndpointError          bench/http.py: it answers, but not as a streaming OpenAI server
├── StatusUnreadable       k8s/cluster.py: `dyn k8s status` cannot read the API server (or finds nothing)
└── LlamaCppError          engines/llamacpp/errors.py: llama.cpp refused a load, decode or state import
"""

from __future__ import annotations

import math


class DynError(Exception):
    """Base of every error dyn raises on purpose; how the CLI, the request plane and the HTTP edge report it
    is read off its class (an instance may say more: a remote worker's status, a queue's retry hint)."""

    exit_code = 1
    """The CLI's exit status."""
    status = 500
    """The HTTP status it maps to (the request plane carries it across processes)."""
    code: str | None = None
    """OpenAI's `error.code`, where there is one."""
    is_migratable = False
    """Whether another worker may take the request over (a worker gone, not a request at fault)."""
    retry_after: float | None = None
    """Seconds a client should wait before trying again (`Retry-After`), where known."""


class ConfigError(DynError):
    """A flag, environment variable or path is wrong; the message says which and what to do."""

    exit_code = 2


class EngineNotInstalled(DynError):
    """The engine's library is not importable."""

    def __init__(self, engine: str, package: str, cause: BaseException | None = None) -> None:
        self.engine = engine
        self.package = package
        detail = f" ({cause})" if cause else ""
        super().__init__(
            f"engine '{engine}' needs {package}, which is not installed{detail}; "
            f"install it with: pip install 'dynamo-cli[{engine}]'"
        )


class UnknownEngine(DynError):
    """`--engine NAME` names no registered plugin."""

    exit_code = 2

    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        self.known = known
        super().__init__(f"unknown engine '{name}'; known engines: {', '.join(sorted(known))}")


class PlaneUnavailable(DynError):
    """A discovery or event plane could not be reached at start."""

    def __init__(self, plane: str, address: str, cause: str) -> None:
        self.plane = plane
        self.address = address
        super().__init__(f"{plane} unreachable at {address}: {cause}")


class PlaneAuthFailed(PlaneUnavailable):
    """etcd or NATS answered but refused the credentials in the URL (or their absence)."""

    def __init__(self, plane: str, url: str, flag: str, cause: str) -> None:
        self.plane = plane
        self.address = url
        """The URL with its secrets hidden (`etcd://dyn:***@host:2379`)."""
        self.flag = flag
        # Not PlaneUnavailable's "unreachable at" message: the server answered, and said no.
        DynError.__init__(
            self, f"{plane} at {url}: authentication failed: check the user/password/token in {flag} ({cause})"
        )


class RequestError(DynError):
    """A client's mistake; the frontend maps it to a 4xx in OpenAI's JSON shape."""

    status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        self.message = message
        self.param = param
        self.code = code
        super().__init__(message)


class ModelNotFound(RequestError):
    """The requested model is served by no registered worker."""

    status = 404
    error_type = "not_found_error"

    def __init__(self, model: str, known: list[str]) -> None:
        served = ", ".join(sorted(known)) or "none"
        super().__init__(
            f"the model '{model}' does not exist; models served here: {served}",
            param="model",
            code="model_not_found",
        )


class ContextOverflow(RequestError):
    """Prompt plus max_tokens does not fit the model's context."""

    def __init__(self, prompt_tokens: int, max_tokens: int, context_length: int) -> None:
        super().__init__(
            f"this model's context is {context_length} tokens, but the prompt has {prompt_tokens} "
            f"and max_tokens is {max_tokens} ({prompt_tokens + max_tokens} in all); "
            "shorten the prompt or lower max_tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )


class UnknownInstance(RequestError):
    """`x-worker-instance-id` (or a router's pin annotation) names no worker of the model."""

    def __init__(self, instance_id: int, model: str, known: list[int]) -> None:
        self.instance_id = instance_id
        self.known = known
        ids = ", ".join(f"{k:x}" for k in sorted(known)) or "none"
        super().__init__(
            f"x-worker-instance-id '{instance_id:x}' names no worker of model '{model}'; "
            f"known instance ids: {ids}; send one of those or drop the header",
            param="x-worker-instance-id",
            code="unknown_instance",
        )


class RequestFailed(DynError):
    """The engine failed one request while serving it (its data broke a step); the other requests go on.

    Not migratable: another worker would fail the same request the same way."""

    status = 500
    is_migratable = False

    def __init__(self, request_id: str, reason: str) -> None:
        self.request_id = request_id
        self.reason = reason
        super().__init__(f"the engine failed request '{request_id}': {reason}; the other requests go on")


class RateLimited(RequestError):
    """429: a key or tenant is over one of its limits (rate, in flight, tokens a minute, queued), which the
    message names; `retry_after` in seconds."""

    status = 429
    error_type = "requests"

    def __init__(self, reason: str, retry_after: float, limit: str = "") -> None:
        super().__init__(f"{reason}; retry in {max(1, math.ceil(retry_after))} s", code="rate_limit_exceeded")
        self.retry_after = retry_after
        self.limit = limit
        """The limit's name in the per-tenant rejection series (max_inflight, tokens_per_minute, max_queued)."""


class Overloaded(DynError):
    """Every worker is over its busy threshold (503, never a hang)."""

    status = 503

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        self.reason = reason
        self.retry_after = retry_after
        """Seconds the client should wait before trying again (`Retry-After`); None if unknown."""
        hint = f"retry in {max(1, math.ceil(retry_after))} s" if retry_after is not None else "retry later"
        super().__init__(f"overloaded: {reason}; {hint}")

    @classmethod
    def relayed(cls, message: str, retry_after: float | None) -> Overloaded:
        """The Overloaded a service behind this one raised (a `dyn router`'s wait queue), with the `message`
        it formatted, not wrapped a second time."""
        exc = cls.__new__(cls)
        exc.reason, exc.retry_after = message, retry_after
        DynError.__init__(exc, message)
        return exc


class KvTransferFull(Overloaded):
    """Holding one more KV payload would pass the transfer server's byte budget."""

    def __init__(self, nbytes: int, held: int, max_bytes: int) -> None:
        self.nbytes = nbytes
        self.held = held
        self.max_bytes = max_bytes
        super().__init__(
            f"the KV transfer server holds {held} bytes awaiting pulls and may hold {max_bytes}, so it cannot"
            f" take {nbytes} more; decode workers must pull (or the client leave) first",
        )


class NoWorkers(DynError):
    """No live instance serves the endpoint."""

    status = 503

    def __init__(self, target: str, retry_after: float | None = None) -> None:
        self.target = target
        self.retry_after = retry_after
        """Seconds until a worker is expected back (`dyn serve` restarting one); None if unknown."""
        hint = "start one with `dyn worker`"
        if retry_after is not None:
            hint = f"retry in {max(1, math.ceil(retry_after))} s"
        super().__init__(f"no worker is serving {target}; {hint}")


class TransportError(DynError):
    """A request-plane failure."""

    status = 502
    code = "worker_error"


class WorkerDisconnected(TransportError):
    """The worker's connection closed while a stream was open."""

    is_migratable = True


class AuthenticationFailed(WorkerDisconnected):
    """A request-plane server did not prove it holds the cluster secret (or refused our proof).

    Migratable: another instance may be a genuine member of the deployment.
    """

    def __init__(self, address: str, reason: str) -> None:
        self.address = address
        self.reason = reason
        super().__init__(
            f"request plane at {address} failed authentication: {reason}; give every process of the"
            " deployment the same cluster secret (--cluster-secret-file PATH or DYN_CLUSTER_SECRET)"
        )


class BackendUnavailable(WorkerDisconnected):
    """A worker's backend (the engine server an http-engine worker forwards to) did not answer, or failed the
    request on its side: migratable, and the worker is out of routing until a canary gets through."""

    status = 502


class StreamTimeout(TransportError):
    """No frame arrived within the idle timeout."""

    is_migratable = True


class WorkerHung(TransportError):
    """The worker sent nothing on any stream, nor a load report, for the stall timeout: it is taken out of
    routing (core/health.py) and its streams migrate."""

    is_migratable = True


class TransferFailed(DynError):
    """A KV payload could not be pulled from a prefill worker; the decode worker prefills locally instead."""

    def __init__(self, address: str, transfer_id: str, reason: str) -> None:
        self.address = address
        self.transfer_id = transfer_id
        self.reason = reason
        super().__init__(
            f"KV pull of {transfer_id[:8]}… from {address} failed: {reason};"
            " the decode worker prefills the prompt itself instead"
        )


class RemoteError(TransportError):
    """The worker failed the request; its message is carried over."""

    def __init__(
        self, message: str, code: str = "engine_error", status: int = 500, retry_after: float | None = None
    ) -> None:
        self.code = code
        self.status = status
        self.retry_after = retry_after
        """A remote Overloaded's hint (seconds), for `Retry-After`; None if it gave none."""
        super().__init__(message)

    @property
    def is_client_error(self) -> bool:
        """The remote side refused the request itself (a 4xx): it is the client's to fix, not a reason to try
        another worker, count a failure against this one or prefill elsewhere."""
        return 400 <= self.status < 500

    def as_request_error(self, param: str | None = None) -> RequestError:
        """This refusal as the client's error at this edge (a 400 naming `param`, the remote code kept)."""
        return RequestError(str(self), param=param, code=self.code)
