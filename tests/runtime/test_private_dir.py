"""The embedded discovery directory is private to its user: a directory a stranger prepared is refused.

The attack: another local user pre-creates the discovery directory world-writable (or owns it) and
plants an instance record, so prompts are routed to a process of theirs. Tests run as root, so the
"other user" is `nobody`.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from dynamo_cli.errors import ConfigError
from dynamo_cli.runtime.embedded import FileDiscovery, default_base, embedded_root

NOBODY = 65534


def start(root: Path) -> None:
    async def run() -> None:
        discovery = FileDiscovery(root, ttl=2.0)
        await discovery.start()
        await discovery.close()

    asyncio.run(run())


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private $XDG_RUNTIME_DIR: the default root is then `{it}/dyn/embedded`."""
    monkeypatch.delenv("DYN_HOME", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def test_the_default_directory_is_created_0700_under_xdg_runtime_dir(runtime_dir: Path) -> None:
    root = embedded_root("embedded")
    assert root == runtime_dir / "dyn" / "embedded"
    start(root)
    assert [mode(p) for p in (root.parent, root, root / "kv", root / "leases")] == [0o700] * 4


def test_without_a_runtime_dir_of_ours_the_default_is_tmp_dyn_uid(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("DYN_HOME", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert default_base() == (Path(f"/tmp/dyn-{os.getuid()}"), True)
    foreign = tmp_path / "run-user-nobody"
    foreign.mkdir()
    os.chown(foreign, NOBODY, NOBODY)  # `su` left another user's runtime dir in the environment
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(foreign))
    assert default_base() == (Path(f"/tmp/dyn-{os.getuid()}"), True)


def test_an_own_0755_default_directory_from_an_older_dyn_is_tightened_to_0700(runtime_dir: Path) -> None:
    base = runtime_dir / "dyn"
    base.mkdir()
    os.chmod(base, 0o755)  # nobody else could write there, so nothing in it can be a stranger's
    start(embedded_root("embedded"))
    assert stat.S_IMODE(os.stat(base).st_mode) == 0o700


@pytest.mark.parametrize("loose", [0o777, 0o775, 0o770], ids=["0777", "0775", "0770"])
def test_a_pre_created_loose_default_directory_is_refused_with_the_fix(runtime_dir: Path, loose: int) -> None:
    base = runtime_dir / "dyn"
    base.mkdir()
    os.chmod(base, loose)
    with pytest.raises(ConfigError) as refused:
        start(embedded_root("embedded"))
    assert str(refused.value) == (
        f"discovery directory {base} has mode {loose:04o}, open to other users: another local user could "
        f"register a fake worker there and receive prompts; run `chmod 700 {base}` or remove it"
    )
    assert not (base / "embedded").exists()


def test_a_default_directory_owned_by_another_user_is_refused(runtime_dir: Path) -> None:
    base = runtime_dir / "dyn"
    (base / "embedded" / "kv").mkdir(parents=True, mode=0o700)
    os.chmod(base, 0o700)
    os.chown(base / "embedded", NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=rf"{base}/embedded is owned by uid {NOBODY}, not by you \(uid 0\).*rm -rf"):
        start(embedded_root("embedded"))


def test_a_symlink_in_place_of_the_default_directory_is_refused(runtime_dir: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (runtime_dir / "dyn").symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        start(embedded_root("embedded"))


def test_an_explicit_world_writable_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(ConfigError, match=rf"{root} has mode 0777, writable by other users.*chmod o-w {root}"):
        start(embedded_root(f"file://{root}"))


def test_an_explicit_root_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=rf"{root} is owned by uid {NOBODY}"):
        start(embedded_root(f"file://{root}"))


def test_an_explicit_root_that_is_ours_may_be_shared_with_our_group(tmp_path: Path) -> None:
    root = tmp_path / "group-shared"
    root.mkdir()
    os.chmod(root, 0o770)
    start(embedded_root(f"file://{root}"))
    fresh = tmp_path / "fresh" / "discovery"
    start(embedded_root(f"file://{fresh}"))
    assert mode(fresh) == 0o700
