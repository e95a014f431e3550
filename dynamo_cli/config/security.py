"""The frontend's security settings: HTTPS and mutual TLS, API keys and the limits each key gets."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dynamo_cli.config.tenants import TenantSpec, key_tenant, merge_tenants
from dynamo_cli.errors import ConfigError
from dynamo_cli.settings import SECURITY, setting


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """HTTPS on the frontend (`--tls-cert-file`, `--tls-key-file`), mutual TLS with `--tls-ca-file`."""

    cert_file: str | None = setting(None, "--tls-cert-file", env="DYN_TLS_CERT_FILE", panel=SECURITY)
    """PEM certificate chain the frontend presents: serve HTTPS (default: plain HTTP)."""
    key_file: str | None = setting(None, "--tls-key-file", env="DYN_TLS_KEY_FILE", panel=SECURITY)
    """PEM private key of the certificate (`--tls-cert-file`)."""
    ca_file: str | None = setting(None, "--tls-ca-file", env="DYN_TLS_CA_FILE", panel=SECURITY)
    """PEM CA bundle: require client certificates it signed (mutual TLS); default: no client certificates.

    The server then verifies clients with ssl.CERT_REQUIRED (frontend/server.py)."""

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            given, missing = (
                ("--tls-cert-file", "--tls-key-file") if self.cert_file else ("--tls-key-file", "--tls-cert-file")
            )
            raise ConfigError(f"{given} was given without {missing}; pass both (or neither, for plain HTTP)")
        if self.ca_file is not None and self.cert_file is None:
            raise ConfigError("--tls-ca-file (mutual TLS) needs --tls-cert-file and --tls-key-file")
        for flag, path in (
            ("--tls-cert-file", self.cert_file),
            ("--tls-key-file", self.key_file),
            ("--tls-ca-file", self.ca_file),
        ):
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{flag} '{path}' is not a readable file; check the path")

    @property
    def is_enabled(self) -> bool:
        return self.cert_file is not None


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """API keys on the frontend and the limits each key gets (`--api-key`, `--api-key-rps`...)."""

    api_keys: tuple[str, ...] = ()
    """Accepted bearer keys; empty = no authentication (the default, bound to 127.0.0.1)."""
    admin_keys: tuple[str, ...] = ()
    """The keys whose key-file line says `role=admin`: the only ones the admin endpoints take (/v1/admin/...)."""
    rps: float = setting(0.0, "--api-key-rps", env="DYN_API_KEY_RPS", panel=SECURITY)
    """Requests per second per key (0: no limit).

    A token bucket per key, burst = max(1, rps)."""
    max_inflight: int = setting(0, "--api-key-max-inflight", env="DYN_API_KEY_MAX_INFLIGHT", panel=SECURITY)
    """Requests in flight at once per key (0: no limit)."""
    metrics_require_key: bool = setting(False, "--metrics-require-key", env="DYN_METRICS_REQUIRE_KEY", panel=SECURITY)
    """`/metrics` needs an API key too (`/health` and `/live` are always open)."""

    def __post_init__(self) -> None:
        if self.rps < 0 or self.max_inflight < 0:
            raise ConfigError(
                f"--api-key-rps ({self.rps}) and --api-key-max-inflight ({self.max_inflight}) must be >= 0"
            )
        if not self.api_keys and (self.rps or self.max_inflight or self.metrics_require_key):
            raise ConfigError(
                "--api-key-rps, --api-key-max-inflight and --metrics-require-key need API keys; "
                "pass --api-key, --api-key-file or DYN_API_KEYS"
            )
        for key in self.api_keys:
            if not key.isascii() or not key.isprintable() or " " in key:
                raise ConfigError(
                    "an API key holds a space or a non-printable or non-ASCII character; "
                    "use printable ASCII keys (e.g. `openssl rand -hex 32`)"
                )


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """The accepted keys and the tenant of each (config/tenants.py)."""

    keys: tuple[str, ...] = ()
    tenants: tuple[TenantSpec, ...] = ()
    admins: tuple[str, ...] = ()
    """The keys given `role=admin`."""


def read_api_keys(flags: Sequence[str], key_file: str | None, environ: Mapping[str, str]) -> ApiKeys:
    """The API keys: `--api-key` flags (else `DYN_API_KEYS`, comma-separated) plus `--api-key-file`'s lines, each
    `KEY [tenant=NAME] [weight=W] ...` (config/tenants.py) and `role=admin` for a key the admin endpoints take; a
    key given twice counts once, its first line's.

    Blank lines and lines starting with `#` in the file are skipped.
    """
    given = list(flags) if flags else environ.get("DYN_API_KEYS", "").split(",")
    lines: list[tuple[str, list[str], str]] = [(k.strip(), [], "--api-key") for k in given if k.strip()]
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--api-key-file '{key_file}' cannot be read ({exc}); check the path") from None
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip() and not line.strip().startswith("#"):
                key, *attributes = line.split()
                lines.append((key, attributes, f"--api-key-file '{key_file}' line {number}"))
        if not lines:
            raise ConfigError(f"--api-key-file '{key_file}' holds no key; put one key per line")
    first = {key: (attributes, where) for key, attributes, where in reversed(lines)}
    keys = tuple(dict.fromkeys(key for key, _, _ in lines))
    admins = tuple(key for key in keys if _is_admin(*first[key]))
    specs = [key_tenant(key, [a for a in first[key][0] if not a.startswith("role=")], first[key][1]) for key in keys]
    return ApiKeys(keys, merge_tenants(specs, [first[key][1] for key in keys]), admins)


def _is_admin(attributes: list[str], where: str) -> bool:
    roles = [a.partition("=")[2] for a in attributes if a.startswith("role=")]
    if any(role != "admin" for role in roles):
        raise ConfigError(f"{where}: role={roles[0]} is unknown; the one role is role=admin")
    return bool(roles)
