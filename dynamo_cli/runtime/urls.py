"""Plane URLs: what `--discovery etcd://…` and `--events nats://…` say, parsed once into typed options.

    etcd://[USER[:PASSWORD]@]HOST[:PORT][,HOST[:PORT]...][?QUERY]      etcds://… turns TLS on
    nats://[USER:PASSWORD@ | TOKEN@]HOST[:PORT][,HOST[:PORT]...][?QUERY]  tls://… turns TLS on

QUERY keys: `ca` (CA bundle that signed the server's certificate; TLS on), `cert` + `key` (this
client's certificate, for mutual TLS), `password-file` (the password, read from a file: keeps it out of
process lists and shell history), and for NATS also `token-file`, `creds` (a `.creds` file of an
NATS account, JWT + nkey seed) and `tls-first=1` (TLS before the server says anything, for servers
configured with `tls { handshake_first: true }`). User and password may be percent-encoded (`%40` for `@`).

Secrets are kept out of `repr` and of `redacted`, the form every message and log line uses.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from dynamo_cli.errors import ConfigError

ETCD_PORT = 2379
NATS_PORT = 4222
_TLS_KEYS = ("ca", "cert", "key")
_ETCD_KEYS = (*_TLS_KEYS, "password-file")
_NATS_KEYS = (*_TLS_KEYS, "password-file", "token-file", "creds", "tls-first")
_HIDDEN = "***"


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """TLS towards a plane server: verify it (against `ca`, else the system's CAs), optionally prove ourselves."""

    ca: str | None = None
    """PEM bundle of the CA that signed the server's certificate; None: the system's trusted CAs."""
    cert: str | None = None
    """This client's certificate (PEM), for servers that require mutual TLS; needs `key`."""
    key: str | None = None
    """The private key of `cert` (PEM)."""


@dataclass(frozen=True, slots=True)
class EtcdTarget:
    """Where etcd is and how to log in."""

    endpoints: tuple[tuple[str, int], ...]
    """(host, port) of each member."""
    user: str | None = None
    """etcd user name; None: no authentication."""
    password: str | None = field(default=None, repr=False)
    """The user's password (never logged)."""
    tls: TlsFiles | None = None
    """TLS settings; None: plain gRPC."""
    redacted: str = ""
    """The URL with the password hidden, for messages."""

    @property
    def address(self) -> str:
        """The endpoints, as `h:p,h:p`."""
        return ",".join(f"{host}:{port}" for host, port in self.endpoints)


@dataclass(frozen=True, slots=True)
class NatsTarget:
    """Where NATS is and how to log in (at most one of user/password, token, creds)."""

    servers: tuple[str, ...]
    """`nats://h:p` or `tls://h:p` per server, without credentials."""
    user: str | None = None
    """NATS user name; None: no user/password authentication."""
    password: str | None = field(default=None, repr=False)
    """The user's password (never logged)."""
    token: str | None = field(default=None, repr=False)
    """An authorization token (never logged)."""
    creds: str | None = None
    """Path of a `.creds` file (JWT + nkey seed)."""
    tls: TlsFiles | None = None
    """TLS settings; None: plain TCP (unless the server demands TLS)."""
    tls_first: bool = False
    """Start TLS before reading the server's INFO (`?tls-first=1`; the server must be set up for it)."""
    redacted: str = ""
    """The URL with the password or token hidden, for messages."""

    @property
    def address(self) -> str:
        """The servers, as `h:p,h:p`."""
        return ",".join(server.partition("://")[2] for server in self.servers)


def parse_etcd_target(url: str) -> EtcdTarget:
    """`etcd[s]://[user[:password]@]h[:p],…[?ca=…&cert=…&key=…&password-file=…]` → EtcdTarget."""
    scheme, userinfo, hosts, query = _split(url, "--discovery", ("etcd", "etcds"))
    options = _query(query, url, "--discovery", _ETCD_KEYS)
    user, password = _userinfo(userinfo)
    password = _from_file(options, "password-file", url, "--discovery", password)
    if password is not None and not user:
        raise ConfigError(f"--discovery '{_redact(url)}' has a password but no user; use etcd://USER:PASSWORD@HOST")
    if user and password is None:
        raise ConfigError(
            f"--discovery '{_redact(url)}' names user '{user}' without a password; "
            "add :PASSWORD after the user or ?password-file=PATH"
        )
    endpoints = tuple(_host_port(part, ETCD_PORT, url, "--discovery") for part in hosts)
    tls = _tls(options, url, "--discovery", is_on=scheme == "etcds")
    return EtcdTarget(endpoints=endpoints, user=user or None, password=password, tls=tls, redacted=_redact(url))


def parse_nats_target(url: str) -> NatsTarget:
    """`nats|tls://[user:password@|token@]h[:p],…[?ca=…&creds=…&token-file=…]` → NatsTarget."""
    scheme, userinfo, hosts, query = _split(url, "--events", ("nats", "tls"))
    options = _query(query, url, "--events", _NATS_KEYS)
    user, password = _userinfo(userinfo)
    token: str | None = None
    if user and password is None and "password-file" not in options:
        user, token = "", user  # nats://TOKEN@host, as nats-server's own URLs
    password = _from_file(options, "password-file", url, "--events", password)
    token = _from_file(options, "token-file", url, "--events", token)
    creds = options.get("creds")
    if password is not None and not user:
        raise ConfigError(f"--events '{_redact(url)}' has a password but no user; use nats://USER:PASSWORD@HOST")
    if sum(x is not None for x in (password, token, creds)) > 1:
        raise ConfigError(f"--events '{_redact(url)}' gives more than one of user/password, token and creds; keep one")
    tls_first = _flag(options, "tls-first", url)
    tls = _tls(options, url, "--events", is_on=scheme == "tls" or tls_first)
    servers = tuple("{}://{}:{}".format(scheme, *_host_port(part, NATS_PORT, url, "--events")) for part in hosts)
    return NatsTarget(
        servers=servers,
        user=user or None,
        password=password,
        token=token,
        creds=creds,
        tls=tls,
        tls_first=tls_first,
        redacted=_redact(url),
    )


def redact_url(url: str) -> str:
    """`scheme://user:secret@host…` → `scheme://user:***@host…`; a lone `nats://TOKEN@` becomes `***`."""
    return _redact(url)


##### Internals #####


def _split(url: str, flag: str, schemes: tuple[str, ...]) -> tuple[str, str, list[str], str]:
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in schemes:
        raise ConfigError(f"{flag} '{_redact(url)}' must start with {' or '.join(s + '://' for s in schemes)}")
    rest, _, query = rest.partition("?")
    userinfo, _, hostlist = rest.rpartition("@")
    hosts = [part for part in hostlist.rstrip("/").split(",") if part]
    if not hosts:
        raise ConfigError(f"{flag} '{_redact(url)}' names no server; use {scheme}://HOST:PORT[,HOST:PORT]")
    return scheme, userinfo, hosts, query


def _query(query: str, url: str, flag: str, known: tuple[str, ...]) -> dict[str, str]:
    options: dict[str, str] = {}
    for key, value in urllib.parse.parse_qsl(query, keep_blank_values=True):
        if key not in known:
            raise ConfigError(f"{flag} '{_redact(url)}': unknown option '{key}'; known options: {', '.join(known)}")
        if not value:
            raise ConfigError(f"{flag} '{_redact(url)}': option '{key}' needs a value ({key}=PATH)")
        options[key] = value
    return options


def _flag(options: dict[str, str], key: str, url: str) -> bool:
    value = options.pop(key, "0").lower()
    if value not in ("0", "1", "true", "false"):
        raise ConfigError(f"--events '{_redact(url)}': option '{key}' takes 1 or 0, not '{value}'")
    return value in ("1", "true")


def _userinfo(userinfo: str) -> tuple[str, str | None]:
    user, sep, password = userinfo.partition(":")
    return urllib.parse.unquote(user), urllib.parse.unquote(password) if sep else None


def _from_file(options: dict[str, str], key: str, url: str, flag: str, inline: str | None) -> str | None:
    path = options.get(key)
    if path is None:
        return inline
    if inline is not None:
        raise ConfigError(f"{flag} '{_redact(url)}' gives the secret both inline and in {key}; keep one")
    try:
        secret = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"{flag}: cannot read {key} '{path}' ({exc.strerror}); fix the path or its permissions"
        ) from None
    if not secret:
        raise ConfigError(f"{flag}: {key} '{path}' is empty; write the secret into it")
    return secret


def _host_port(part: str, default_port: int, url: str, flag: str) -> tuple[str, int]:
    host, sep, port = part.rpartition(":")
    if not sep:
        host, port = part, str(default_port)
    if not host or not port.isdigit():
        raise ConfigError(f"{flag} '{_redact(url)}': '{part}' is not HOST:PORT")
    return host, int(port)


def _tls(options: dict[str, str], url: str, flag: str, *, is_on: bool) -> TlsFiles | None:
    if not is_on and not any(key in options for key in _TLS_KEYS):
        return None
    if ("cert" in options) != ("key" in options):
        raise ConfigError(f"{flag} '{_redact(url)}': give cert and key together (mutual TLS), or neither")
    return TlsFiles(ca=options.get("ca"), cert=options.get("cert"), key=options.get("key"))


def _redact(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    head, at, tail = rest.partition("?")[0].rpartition("@")
    if not at:
        return url
    user, colon, _ = head.partition(":")
    is_token = not colon and scheme in ("nats", "tls")  # nats://TOKEN@host; etcd://USER@host is a name
    hidden = f"{user}:{_HIDDEN}" if colon else _HIDDEN if is_token else user
    return f"{scheme}://{hidden}@{rest[len(head) + 1 :]}"
