"""docs/reference/ is generated (scripts/docs_reference.py): a page that differs from what the code says now
is stale."""

from __future__ import annotations

import importlib.util
import pkgutil
from types import ModuleType

import dynamo_cli
from tests.docs.blocks import ROOT


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "scripts" / "docs_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_pages_are_up_to_date() -> None:
    script = _script()
    pages = script.render_all()
    stale = script.stale_pages(pages)
    assert not stale, f"docs/reference/ {', '.join(stale)} stale: run `make docs-reference`"
    for name, text in pages.items():
        assert str(ROOT) not in text, f"{name} shows a path of this machine"


def test_every_module_with_public_msgspec_structs_is_in_the_wire_reference_or_excused() -> None:
    script = _script()
    found = set()
    for info in pkgutil.walk_packages(dynamo_cli.__path__, "dynamo_cli."):
        module = importlib.import_module(info.name)
        if script.wire_structs(module):
            found.add(info.name)
    listed = set(script.WIRE_MODULES) | set(script.NOT_WIRE)
    assert found - listed == set(), "add them to WIRE_MODULES or NOT_WIRE in scripts/docs_reference.py"
    assert listed - found == set(), "they define no public msgspec struct: remove them from the script's lists"
