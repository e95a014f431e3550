"""Size gates from STYLE.md: no module over 600 lines."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_module_is_over_600_lines() -> None:
    big = {
        str(p.relative_to(ROOT)): n
        for p in [*ROOT.glob("dynamo_cli/**/*.py"), *ROOT.glob("engines/**/*.py")]
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert big == {}
