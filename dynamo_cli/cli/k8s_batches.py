"""`dyn k8s render`'s batch database: where the frontend pod keeps its batches, so that they outlive the pod.

A SQLite file (the default, or a path) moves onto a PersistentVolumeClaim mounted read-write in the frontend
pod; without one it would sit under `HOME=/tmp`, an emptyDir a restart empties. A PostgreSQL URL is passed
through as given, and its password, never written in the URL, reaches the pod as PGPASSWORD (the variable
libpq reads) from a Secret made from `--batch-db-password-file`.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from dynamo_cli.config.batch import is_postgres
from dynamo_cli.errors import ConfigError
from dynamo_cli.k8s.names import BATCH_DB_KEY, BATCHES_DIR, Names
from dynamo_cli.k8s.objects import Mount, SecretEnv
from dynamo_cli.k8s.render import SecretSource

BATCH_DB = f"{BATCHES_DIR}/batches.db"
"""The frontend's `--batch-db` on the claim (its files directory, `batches-files/`, beside it)."""
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")


@dataclass(frozen=True, slots=True)
class BatchStorage:
    """What the frontend pod gets for its batches: its `--batch-db`, mounts, variables and Secret."""

    db: str
    """`--batch-db` as the pod's command line holds it."""
    mounts: tuple[Mount, ...] = ()
    secret_env: tuple[SecretEnv, ...] = ()
    secret: SecretSource | None = None
    """The Secret `secret_env` reads, made by a printed `kubectl create secret` line."""


def batch_storage(db: str, storage: str, password_file: Path | None, names: Names) -> BatchStorage:
    """The frontend pod's batch database for `--batch-db DB`: a claim of `storage` for SQLite, PGPASSWORD from
    `password_file` for PostgreSQL, nothing when off."""
    if password_file is not None and not is_postgres(db):
        raise ConfigError(
            "--batch-db-password-file is the password of a PostgreSQL --batch-db, and --batch-db is "
            f"'{db or 'the default SQLite file'}'; pass --batch-db postgresql://USER@HOST/DB, or drop the file"
        )
    if db == "off":
        return BatchStorage(db)
    if is_postgres(db):
        return _postgres(db, password_file, names)
    if not _QUANTITY.fullmatch(storage):
        raise ConfigError(f"--batch-storage '{storage}' is not a Kubernetes quantity; write it as 10Gi or 500Mi")
    claim = Mount("batches", BATCHES_DIR, claim=names.batches, writable=True, size=storage)
    return BatchStorage(BATCH_DB, mounts=(claim,))


def _postgres(url: str, password_file: Path | None, names: Names) -> BatchStorage:
    parts = urllib.parse.urlsplit(url)
    query = {key for key, _ in urllib.parse.parse_qsl(parts.query)}
    if parts.password is not None or "password" in query:
        raise ConfigError(
            "--batch-db holds a password, which would be written into the manifests; drop it from the URL and "
            "put it in a file: --batch-db-password-file FILE (the pod reads it as PGPASSWORD)"
        )
    if password_file is None:  # a server that needs no password (trust, client certificates): nothing to add
        return BatchStorage(url)
    _check_password_file(password_file)
    secret = SecretSource(names.batch_db, ((BATCH_DB_KEY, str(password_file)),))
    env = SecretEnv("PGPASSWORD", names.batch_db, BATCH_DB_KEY)
    return BatchStorage(url, secret_env=(env,), secret=secret)


def _check_password_file(path: Path) -> None:
    """A readable file holding the password alone: `kubectl create secret --from-file` keeps every byte, and
    libpq would send a trailing newline as part of the password."""
    flag = "--batch-db-password-file"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{flag} '{path}' cannot be read ({exc}); check the path") from None
    if not text:
        raise ConfigError(f"{flag} '{path}' is empty; put the database user's password in it")
    if "\n" in text or "\r" in text:
        raise ConfigError(
            f"{flag} '{path}' holds a line break, which would become part of PGPASSWORD; write the password "
            "alone, with no newline: printf '%s' \"$PASSWORD\" > FILE"
        )
