"""The etcd gRPC client with credentials: user/password login, TLS (which aetcd lacks), auth error triage.

aetcd 1.0 logs in (Authenticate → token sent as metadata on every call) but dials plain gRPC only,
so `TlsClient` repeats its `connect()` with a secure channel. etcd keeps login tokens in memory: after
etcd restarts, calls fail with "invalid auth token" until the client logs in again, which
`is_stale_token` detects and closing the client (the next call reconnects and logs in) repairs.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aetcd
import grpc
from aetcd import rpc, watcher

from dynamo_cli.errors import ConfigError
from dynamo_cli.runtime.urls import EtcdTarget, TlsFiles

# What etcd answers when credentials are wrong, missing, or not allowed to read dyn's keys.
_AUTH_FAILURES = (
    "authentication failed",
    "user name is empty",
    "user name not found",
    "permission denied",
    "authentication is not enabled",  # we sent a password to an etcd that takes anyone: refuse to go on
    "invalid auth token",
)


def new_client(target: EtcdTarget, host: str, port: int, *, timeout: int, options: dict[str, Any]) -> aetcd.Client:
    """An aetcd client for `target`'s credentials and TLS (not connected yet: the first call connects)."""
    if target.tls is None:
        return aetcd.Client(
            host, port, username=target.user, password=target.password, timeout=timeout, options=options
        )
    if len(target.endpoints) > 1:
        # The ipv4: multi-address target carries no name; verify the certificate against the first host's.
        options = {**options, "grpc.ssl_target_name_override": target.endpoints[0][0]}
    return TlsClient(
        host,
        port,
        username=target.user,
        password=target.password,
        timeout=timeout,
        options=options,
        credentials=channel_credentials(target.tls),
    )


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """gRPC TLS credentials from the URL's `ca`, `cert` and `key` files; ConfigError names an unreadable one."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca, "ca"),
        private_key=_read(tls.key, "key"),
        certificate_chain=_read(tls.cert, "cert"),
    )


def is_auth_failure(exc: BaseException) -> bool:
    """Did etcd refuse us for who we are (or are not), rather than being out of reach?"""
    if isinstance(exc, aetcd.exceptions.UnauthenticatedError):
        return True
    return isinstance(exc, aetcd.ClientError) and any(text in str(exc) for text in _AUTH_FAILURES)


def is_stale_token(exc: BaseException) -> bool:
    """Is this etcd forgetting our login token (it restarted), so that logging in again repairs it?"""
    return isinstance(exc, aetcd.ClientError) and "invalid auth token" in str(exc)


class TlsClient(aetcd.Client):  # type: ignore[misc]  # aetcd is untyped
    """aetcd.Client over a TLS channel: `connect()` is aetcd 1.0's, with `secure_channel` for `insecure_channel`."""

    def __init__(self, *args: Any, credentials: grpc.ChannelCredentials, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._credentials = credentials

    async def connect(self) -> None:
        """Open the TLS channel and log in when a user is set (aetcd's steps, same attributes)."""
        try:
            await self._connect()
        except rpc.AioRpcError as exc:
            aetcd.exceptions._handle_exception(exc)

    async def _connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # type: ignore[has-type]  # another task is connecting: wait for it
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            self.channel = rpc.secure_channel(target, self._credentials, options=self._options.items())
            if self._username is not None and self._password is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                request = rpc.AuthenticateRequest(name=self._username, password=self._password)
                reply = await self.auth_stub.Authenticate(request, timeout=self._timeout)
                self.metadata = (("token", reply.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"--discovery: cannot read the TLS {what} file '{path}' ({exc.strerror}); fix ?{what}=PATH"
        ) from None
