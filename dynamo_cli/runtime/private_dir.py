"""A directory other local users cannot write: created mode 0700, an existing one checked as ssh checks `~/.ssh`.

Whoever can write the embedded discovery directory can plant an instance record and have prompts
routed to a process of theirs, so dyn refuses a directory another user could have prepared.
Two levels of strictness:

- `strict` (a directory dyn chose: `/tmp/dyn-UID`, `$XDG_RUNTIME_DIR/dyn`, `.../embedded`): owned by
  this user, not a symbolic link, and no permission bit for group or others (0700).
- not strict (a directory the operator named: `--discovery file:///DIR`, `DYN_HOME`): owned by this
  user or root, never writable by others, and writable by its group only when it is this user's own
  (a deliberate shared-group setup). The operator chose it; dyn only refuses what a stranger could
  have written into.

A directory dyn creates is always created 0700. One left by an older dyn with mode 0755 (this
user's, no write bit for anyone else, so nothing in it can be a stranger's) is tightened to 0700.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dynamo_cli.errors import ConfigError


def ensure_private_dir(path: Path, *, strict: bool) -> None:
    """Create `path` (0700, parents as needed) or check the existing one; ConfigError says what to fix."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path) if strict else os.stat(path)
    except OSError as exc:
        raise ConfigError(
            f"discovery directory {path} cannot be created or read: {exc.strerror}; "
            "fix the path or its parent's permissions"
        ) from None
    if strict and _is_own_readable_only(st, os.getuid()):
        os.chmod(path, 0o700)  # e.g. 0755 from an older dyn: readable by others, never writable by them
        st = os.lstat(path)
    problem = refusal(st, os.getuid(), strict=strict)
    if problem is not None:
        what, fix = problem
        raise ConfigError(
            f"discovery directory {path} {what}: another local user could register a fake worker there and "
            f"receive prompts; {fix.format(path=path)}"
        )


def _is_own_readable_only(st: os.stat_result, uid: int) -> bool:
    mode = stat.S_IMODE(st.st_mode)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and mode & 0o077 != 0 and mode & 0o022 == 0


def refusal(st: os.stat_result, uid: int, *, strict: bool) -> tuple[str, str] | None:
    """Why a directory with status `st` is refused for user `uid` (what, fix with {path}), or None."""
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link", "remove it (`rm {path}`) and start again"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory", "remove it (`rm {path}`) or choose another --discovery file:///DIR"
    owners = (uid,) if strict else (uid, 0)
    if st.st_uid not in owners:
        return (
            f"is owned by uid {st.st_uid}, not by you (uid {uid})",
            "remove it (`rm -rf {path}`) or choose a directory of your own with --discovery file:///DIR",
        )
    loose = 0o077 if strict else (0o002 if st.st_uid == uid else 0o022)
    if mode & loose:
        wanted = "700" if strict else ("o-w" if st.st_uid == uid else "go-w")
        opened = "open to other users" if strict else "writable by other users"
        return f"has mode {mode:04o}, {opened}", f"run `chmod {wanted} {{path}}` or remove it"
    return None
