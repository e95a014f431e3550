"""NATS events: the multi-node event plane, core NATS for fire-and-forget, JetStream where replay matters.

Core subjects (`namespace.{ns}.component.{c}.kv-metrics`, ...) are at most once, like the embedded
bus. KV events also land in a JetStream stream (`ensure_stream`), so a router that starts late or
restarts reads them again from a sequence number (`subscribe_replay`) instead of missing them.
The client reconnects forever; what a subscriber cannot keep up with is dropped and counted.
Credentials (user/password, token, creds file) and TLS come from the URL (urls.py); a server that
refuses them fails start() with PlaneAuthFailed. NOTE: nats-py upgrades to TLS only when the server's
first line (INFO, in clear) asks for it, and sends CONNECT (with the credentials) right after. With
TLS requested, `_TlsOrNothing` refuses an INFO that does not ask for TLS before CONNECT is written, so
a fake server (or a man in the middle) downgrading the connection learns no password, token or JWT.
`?tls-first=1` goes further: TLS from the first byte, for servers set to `handshake_first`.
"""

from __future__ import annotations

import asyncio
import enum
import importlib.util
import logging
import ssl
from typing import Any

import nats
import nats.errors
import nats.js.api
import nats.js.errors
from nats.aio.client import DEFAULT_FLUSH_TIMEOUT, Client
from nats.aio.msg import Msg

from dynamo_cli.errors import ConfigError, PlaneAuthFailed, PlaneUnavailable
from dynamo_cli.runtime.events import SUBSCRIBER_QUEUE
from dynamo_cli.runtime.urls import NatsTarget, TlsFiles, parse_nats_target

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 3.0
"""How long start() waits for the server before raising PlaneUnavailable."""
CALL_TIMEOUT_S = 3.0
"""Deadline of a JetStream management call or a flush."""
RECONNECT_WAIT_S = 0.5
"""Pause between two attempts to reach a lost server; the client retries forever."""
START_ATTEMPTS = 2
"""Retries of each server at start (about a second in all) before PlaneUnavailable."""
STREAM_MAX_AGE_S = 3600.0
"""How long a JetStream stream keeps KV events for late subscribers (default)."""
STREAM_MAX_MSGS = 1_000_000
"""How many KV events a stream keeps (default); the oldest go first."""

_CLOSED = object()


class _State(enum.Enum):
    IDLE = "idle"  # built, start() not called yet
    CONNECTED = "connected"  # start() succeeded; the client reconnects by itself from here
    CLOSED = "closed"  # drained and disconnected; terminal


def parse_nats_url(url: str) -> list[str]:
    """`nats://h1:p1,h2:p2` → ["nats://h1:p1", "nats://h2:p2"] (`tls://` kept; urls.py has the rest)."""
    return list(parse_nats_target(url).servers)


def connect_options(target: NatsTarget) -> dict[str, Any]:
    """nats-py `connect()` keywords for the target's credentials and TLS; ConfigError for bad files."""
    options: dict[str, Any] = {}
    if target.user is not None:
        options.update(user=target.user, password=target.password)
    if target.token is not None:
        options["token"] = target.token
    if target.creds is not None:
        if importlib.util.find_spec("nkeys") is None:
            raise ConfigError(
                f"--events '{target.redacted}': ?creds= needs the nkeys package; pip install 'dynamo-cli[nats-creds]'"
            )
        options["user_credentials"] = target.creds
    if target.tls is not None:
        options["tls"] = ssl_context(target.tls)
        options["tls_handshake_first"] = target.tls_first
    return options


def ssl_context(tls: TlsFiles) -> ssl.SSLContext:
    """A client context verifying the server against `tls.ca` (else the system CAs), with our cert if given."""
    try:
        context = ssl.create_default_context(cafile=tls.ca)
        if tls.cert is not None:
            context.load_cert_chain(tls.cert, tls.key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"--events: cannot load the TLS files (ca={tls.ca}, cert={tls.cert}, key={tls.key}): {exc}; "
            "fix the ?ca=, ?cert=, ?key= paths"
        ) from None
    return context


class NatsSubscription:
    """A subscription's bounded queue of (subject, payload).

    Overflow policy: a live subscription drops and counts (`dropped`) when its consumer lags, so
    no publisher waits; a replay subscription (`is_lossless`) holds back instead, and JetStream's
    flow control slows the server down, because a replay with holes would defeat its purpose.
    """

    def __init__(self, subject: str, *, maxsize: int = SUBSCRIBER_QUEUE, is_lossless: bool = False) -> None:
        self.subject = subject
        self.is_lossless = is_lossless
        self.dropped = 0
        """Messages dropped because the consumer was slower than the publishers."""
        self.last_seq = 0
        """Stream sequence of the last message iterated (JetStream only); resume at last_seq + 1."""
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize)
        self._nats_sub: Any = None
        self._is_closed = False
        self._is_ended = False

    def __aiter__(self) -> NatsSubscription:
        return self

    async def __anext__(self) -> tuple[str, bytes]:
        """The next message; cancelling the wait loses nothing. Ends after close()."""
        if self._is_ended:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _CLOSED:
            self._is_ended = True
            raise StopAsyncIteration
        subject, payload, seq = item
        if seq:
            self.last_seq = seq
        return subject, payload

    async def close(self) -> None:
        """Stop receiving; the iterator ends after what was already queued. Idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        if self._nats_sub is not None:
            try:
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    await self._nats_sub.unsubscribe()
            except (nats.errors.Error, TimeoutError) as exc:
                logger.debug("nats: unsubscribe %s failed (%s)", self.subject, exc)
        if self._queue.full():
            self._queue.get_nowait()  # make room for the end marker; we are closing anyway
            self.dropped += 1
        self._queue.put_nowait(_CLOSED)

    async def _on_message(self, msg: Msg) -> None:
        if self._is_closed:
            return
        # A JetStream delivery carries its stream sequence in the reply subject; core NATS has none.
        seq = msg.metadata.sequence.stream if msg.reply.startswith("$JS.ACK.") else 0
        if self.is_lossless:
            await self._queue.put((msg.subject, msg.data, seq))
            return
        try:
            self._queue.put_nowait((msg.subject, msg.data, seq))
        except asyncio.QueueFull:
            self.dropped += 1
            if self.dropped == 1:  # report once; the counter tells the rest
                logger.warning(
                    "nats: subscriber of %s is too slow; dropping events (queue %d full)",
                    self.subject,
                    self._queue.maxsize,
                )


class _FlushInOrder(Client):
    """A client whose `flush()` PING goes behind what was sent before it, as in the other NATS clients, so
    that its PONG proves the server has processed all of that: a SUB (`subscribe` + `flush`: the server
    routes the subject to it from now on), an UNSUB, the last publishes.

    NOTE: nats-py's `flush()` writes its PING straight to the socket (`_send_ping`), while `subscribe`,
    `publish` and `unsubscribe` queue their commands for its flusher task, which runs only once the
    caller awaits. A SUB queued just before thus reached the server after the PING, and the PONG could
    come before the server knew the subscription: a message published right after `subscribe()` returned
    then went to no one. Hooks nats-py's `_flush_pending`, which hands the queue to the socket (nats-py is
    pinned below 3)."""

    async def flush(self, timeout: int = DEFAULT_FLUSH_TIMEOUT) -> None:
        if self.is_connected:
            async with asyncio.timeout(timeout):  # nats-py would wait for its flusher task without a deadline
                await self._flush_pending(force_flush=True)
        await super().flush(timeout)


class _TlsOrNothing(_FlushInOrder):
    """A client that, asked for TLS, never speaks in clear: an INFO without `tls_required` is refused
    before CONNECT (and its credentials) is sent. Hooks nats-py's `_process_info`, which every
    connection attempt calls between reading INFO and upgrading to TLS (nats-py is pinned below 3)."""

    def __init__(self, *, require_tls: bool) -> None:
        super().__init__()
        self._require_tls = require_tls

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        if self._require_tls and initial_connection and not info.get("tls_required"):
            raise nats.errors.Error("TLS was requested (tls:// or ?ca=) but the server does not speak TLS")
        await super()._process_info(info, initial_connection)


class NatsEventBus:
    """`EventBus` on NATS, plus JetStream replay for KV events (`ensure_stream`, `subscribe_replay`)."""

    def __init__(self, url: str, *, queue_size: int = SUBSCRIBER_QUEUE) -> None:
        self._target = parse_nats_target(url)
        self._servers = list(self._target.servers)
        self._queue_size = queue_size
        self._state = _State.IDLE
        self._client: Client = _TlsOrNothing(require_tls=self._target.tls is not None)
        self._subscriptions: list[NatsSubscription] = []
        self._last_error: Exception | None = None
        self._is_refused = False  # the server answered "Authorization Violation" at least once
        self.num_publish_dropped = 0
        """Messages publish() could not hand to the client (its buffer was full while disconnected)."""

    @property
    def address(self) -> str:
        """The servers, for messages."""
        return ",".join(server.partition("://")[2] for server in self._servers)

    async def start(self) -> None:
        """Connect; PlaneUnavailable names the address when no server answers (in 1-3 s)."""
        if self._state is not _State.IDLE:
            return
        options = connect_options(self._target)
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                await self._client.connect(
                    self._servers,
                    **options,
                    connect_timeout=START_TIMEOUT_S,  # type: ignore[arg-type]  # nats-py takes float
                    reconnect_time_wait=RECONNECT_WAIT_S,  # type: ignore[arg-type]
                    max_reconnect_attempts=START_ATTEMPTS,
                    error_cb=self._on_error,
                    disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected,
                )
            # A few tries at start so a wrong address fails fast; once connected, retry forever.
            self._client.options["max_reconnect_attempts"] = -1
        except (nats.errors.Error, OSError, TimeoutError) as exc:
            await self._client.close()
            if self._is_refused or _is_auth_failure(exc):
                cause = "the server refused them" if self._has_credentials() else "the server requires them"
                raise PlaneAuthFailed("nats", self._target.redacted, "--events", cause) from None
            cause = _describe(exc)
            if self._last_error is not None:
                cause += f" (last error: {_describe(self._last_error)})"
            raise PlaneUnavailable("nats", self.address, cause) from None
        self._state = _State.CONNECTED
        logger.info("nats at %s: connected", self.address)

    async def publish(self, subject: str, payload: bytes) -> None:
        """Send without waiting for any subscriber; while the server is away the client buffers."""
        try:
            await self._client.publish(subject, payload)
        except nats.errors.OutboundBufferLimitError:
            self.num_publish_dropped += 1
            if self.num_publish_dropped == 1:
                logger.warning("nats at %s: outbound buffer full while disconnected; dropping events", self.address)

    async def subscribe(self, subject: str) -> NatsSubscription:
        """Receive every message published on `subject` from now on (`*` and trailing `>` allowed)."""
        sub = NatsSubscription(subject, maxsize=self._queue_size)
        sub._nats_sub = await self._client.subscribe(subject, cb=sub._on_message)
        await self._flush()  # the server knows the interest when this returns
        self._subscriptions.append(sub)
        return sub

    async def ensure_stream(
        self,
        name: str,
        subjects: list[str],
        *,
        max_age_s: float = STREAM_MAX_AGE_S,
        max_msgs: int = STREAM_MAX_MSGS,
    ) -> None:
        """Create the JetStream stream `name` capturing `subjects` unless it exists (then leave it)."""
        js = self._client.jetstream(timeout=CALL_TIMEOUT_S)
        try:
            await js.stream_info(name)
            return
        except nats.js.errors.NotFoundError:
            pass
        config = nats.js.api.StreamConfig(
            name=name,
            subjects=subjects,
            max_age=max_age_s,
            max_msgs=max_msgs,
            storage=nats.js.api.StorageType.FILE,
            discard=nats.js.api.DiscardPolicy.OLD,
        )
        try:
            await js.add_stream(config)
        except nats.js.errors.BadRequestError as exc:
            try:
                await js.stream_info(name)  # another process created it meanwhile: fine
            except nats.js.errors.NotFoundError:
                raise ConfigError(
                    f"JetStream stream '{name}' for {subjects} cannot be created: {exc.description}; "
                    "remove the stream that already captures these subjects (nats stream rm)"
                ) from None

    async def subscribe_replay(self, subject: str, *, stream: str, start_seq: int = 1) -> NatsSubscription:
        """Every message of `stream` on `subject` from `start_seq` on, then new ones, in order.

        An ordered consumer: it skips nothing and restarts itself after a reconnect. Keep
        `subscription.last_seq` to resume a later run at `last_seq + 1`.
        """
        sub = NatsSubscription(subject, maxsize=self._queue_size, is_lossless=True)
        js = self._client.jetstream(timeout=CALL_TIMEOUT_S)
        sub._nats_sub = await js.subscribe(
            subject,
            stream=stream,
            cb=sub._on_message,
            ordered_consumer=True,
            deliver_policy=nats.js.api.DeliverPolicy.BY_START_SEQUENCE,
            config=nats.js.api.ConsumerConfig(opt_start_seq=max(1, start_seq)),
        )
        self._subscriptions.append(sub)
        return sub

    async def close(self) -> None:
        """Flush what was published, end every subscription and disconnect. Idempotent."""
        if self._state is _State.CLOSED:
            return
        was_connected = self._state is _State.CONNECTED
        self._state = _State.CLOSED
        for sub in self._subscriptions:
            await sub.close()
        if was_connected:
            await self._flush()
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                await self._client.close()
        except TimeoutError:
            logger.warning("nats at %s: close did not finish within %g s", self.address, CALL_TIMEOUT_S)

    ##### Internals #####

    def _has_credentials(self) -> bool:
        return any(x is not None for x in (self._target.user, self._target.token, self._target.creds))

    async def _flush(self) -> None:
        try:
            await self._client.flush(timeout=CALL_TIMEOUT_S)  # type: ignore[arg-type]
        except (nats.errors.Error, TimeoutError) as exc:
            logger.debug("nats at %s: flush failed (%s)", self.address, exc)

    async def _on_error(self, exc: Exception) -> None:
        self._last_error = exc
        self._is_refused = self._is_refused or _is_auth_failure(exc)
        logger.debug("nats at %s: %s", self.address, _describe(exc))

    async def _on_disconnected(self) -> None:
        if self._state is _State.CONNECTED:
            logger.warning("nats at %s: disconnected; retrying every %.1f s", self.address, RECONNECT_WAIT_S)

    async def _on_reconnected(self) -> None:
        logger.info("nats at %s: reconnected", self.address)


def _is_auth_failure(exc: BaseException | None) -> bool:
    if isinstance(exc, nats.errors.AuthorizationError):
        return True
    return exc is not None and "authorization violation" in str(exc).lower()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {START_TIMEOUT_S:g} s"
    return str(exc) or type(exc).__name__
