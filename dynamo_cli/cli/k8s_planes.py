"""`dyn k8s render --etcd URL / --nats URL`: an external plane's URL as the pods use it. Files it names (CA,
client certificate and key, password/token files, NATS creds) move into one Secret mounted at PLANES_DIR, and
the URL is rewritten to their mounted paths; a password or token written in the URL itself is refused, since
it would land in the manifests."""

from __future__ import annotations

import os
import urllib.parse

from dynamo_cli.errors import ConfigError
from dynamo_cli.k8s.names import PLANES_DIR
from dynamo_cli.runtime.urls import parse_etcd_target, parse_nats_target

FILE_KEYS = ("ca", "cert", "key", "password-file", "token-file", "creds")
"""Query keys whose values are local files."""


def plane_url(value: str, flag: str, bundled: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """(the URL the pods use, the (Secret key, local file) pairs of the planes Secret) for `--etcd`/`--nats`."""
    if value == "bundled":
        return bundled, ()
    parse = parse_etcd_target if flag == "--etcd" else parse_nats_target
    target = parse(value)  # checks it as the pods will (and that its files exist here)
    query = urllib.parse.parse_qsl(urllib.parse.urlsplit(value).query)
    keys = {k for k, _ in query}
    inline_password = getattr(target, "password", None) is not None and "password-file" not in keys
    inline_token = getattr(target, "token", None) is not None and "token-file" not in keys
    if inline_password or inline_token:
        raise ConfigError(
            f"{flag} '{target.redacted}' holds a password or token, which would be written into the manifests; "
            "put it in a file and name it: ?password-file=FILE (or ?token-file=FILE)"
        )
    prefix = flag.lstrip("-")
    files: list[tuple[str, str]] = []
    rewritten: list[tuple[str, str]] = []
    for key, path in query:
        if key in FILE_KEYS:
            secret_key = f"{prefix}-{key}-{os.path.basename(path)}"
            files.append((secret_key, path))
            path = f"{PLANES_DIR}/{secret_key}"
        rewritten.append((key, path))
    base, _, _ = value.partition("?")
    url = base + ("?" + urllib.parse.urlencode(rewritten, safe="/") if rewritten else "")
    return url, tuple(files)
