"""Settings declared once: a router setting added as one field reaches `dyn router` children of `dyn serve`.

The test copies the package, adds one field (with its Setting) to KvRouterConfig in the copy, and nothing
else; `dyn serve --routers 2` from the copy must then take the new flag and hand its value to both routers,
which show their settings in `best_worker_id`.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from tests.conftest import DynProcess, wait_until
from tests.e2e.test_router_service import ENV, best_worker, of

ROOT = Path(__file__).resolve().parents[2]
NEW_FIELD = '''
    canary: int = setting(0, "--router-canary", env="DYN_ROUTER_CANARY", help="Added by a test.", panel=ROUTING)
    """A setting the test adds in this one place."""
'''


def copy_with_a_new_router_setting(tmp_path: Path) -> Path:
    """A copy of dynamo_cli whose KvRouterConfig has one more field; the directory to put on PYTHONPATH."""
    root = tmp_path / "patched"
    shutil.copytree(ROOT / "dynamo_cli", root / "dynamo_cli", ignore=shutil.ignore_patterns("__pycache__"))
    routing = root / "dynamo_cli" / "config" / "routing.py"
    text = routing.read_text()
    anchor = '    """KV bytes of one block; None = the card\'s, else KV_BYTES_PER_TOKEN per token."""\n'
    assert text.count(anchor) == 1
    routing.write_text(text.replace(anchor, anchor + NEW_FIELD))
    return root


@pytest.mark.timeout(180)
def test_a_router_setting_added_as_one_field_reaches_both_routers_of_dyn_serve(dyn_serve, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    patched = copy_with_a_new_router_setting(tmp_path)
    env = {**ENV, "PYTHONPATH": str(patched), "PYTHONSAFEPATH": "1"}  # the copy, not the checkout, for every child
    flags = ["--engine", "mocker", "--router", "remote", "--routers", "2", "--router-canary", "7"]
    d: DynProcess = dyn_serve(*flags, env=env)
    assert wait_until(lambda: len(of(d, "router")) == 2, timeout=60, interval=0.5)
    for row in of(d, "router"):
        settings = asyncio.run(best_worker(row["address"], [1, 2, 3]))["settings"]
        assert settings["kv_router"]["canary"] == 7, row
