"""OpenAI's Batch API settings: where batches are kept, how much of the workers they may take, input limits."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dynamo_cli.errors import ConfigError
from dynamo_cli.settings import BATCH, IN_MIB, setting


def is_postgres(db: str) -> bool:
    """Whether `--batch-db` names a PostgreSQL database (a URL) rather than a SQLite file."""
    return db.startswith(("postgresql://", "postgres://"))


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """OpenAI's Batch API on the frontend: where batches are kept and how much of the workers they may take."""

    db: str = setting("", "--batch-db", env="DYN_BATCH_DB", panel=BATCH)
    """Where batches are kept: a SQLite file (default: $DYN_STATE_DIR/NAMESPACE/batches.db, $DYN_STATE_DIR being
    ~/.local/state/dyn if unset), a postgresql:// URL shared by frontends on several hosts (password from
    PGPASSWORD), or off (no /v1/files, /v1/batches).

    The default file is shared by the frontends of one `dyn serve`; the password never goes on the command line
    (libpq reads PGPASSWORD)."""
    max_inflight: int = setting(0, "--batch-max-inflight", env="DYN_BATCH_MAX_INFLIGHT", panel=BATCH)
    """Batch lines running at once across the workers (0: half the requests the workers serving the batch's model
    run before they count as busy).

    The 0 default leaves room for interactive requests."""
    max_file_bytes: int = setting(
        200 * 1024 * 1024,
        "--batch-max-file-mb",
        env="DYN_BATCH_MAX_FILE_MB",
        panel=BATCH,
        **IN_MIB,
    )
    """Largest batch input file (MiB)."""
    max_lines: int = setting(50_000, "--batch-max-lines", env="DYN_BATCH_MAX_LINES", panel=BATCH)
    """Most lines in a batch input file."""

    def __post_init__(self) -> None:
        if self.max_inflight < 0 or self.max_file_bytes <= 0 or self.max_lines <= 0:
            raise ConfigError(
                f"--batch-max-inflight must be >= 0 ({self.max_inflight}), --batch-max-file-mb and --batch-max-lines"
                f" > 0 ({self.max_file_bytes / 1024 / 1024:g}, {self.max_lines})"
            )

    @property
    def is_enabled(self) -> bool:
        return self.db != "off"

    def where(self, namespace: str) -> str:
        """The database of `namespace`'s batches: a URL, or a SQLite file's path."""
        if is_postgres(self.db):
            return self.db
        if self.db:
            return str(Path(self.db).expanduser())
        state = os.environ.get("DYN_STATE_DIR") or str(Path.home() / ".local" / "state" / "dyn")
        return str(Path(state) / namespace / "batches.db")
