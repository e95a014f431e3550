"""Sizes of the seams STYLE.md rule 21 caps: modules (600 lines), classes (300) and functions (40), in the
package, the engines and the benchmarks; `make sz` prints them, tests/test_layout.py holds the known excesses
to a list that may only shrink.

    python scripts/seams.py    # the largest modules, every class and function over its cap, function p50/p90

A function is measured from its `def` (decorators left out) to its last line, signature included: a 113-line
signature is a 113-line function to read.
"""

from __future__ import annotations

import ast
import statistics
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ("dynamo_cli", "engines", "benchmarks")
CAPS = {"module": 600, "class": 300, "function": 40}


@dataclass(frozen=True)
class Seam:
    kind: str
    """"module", "class" or "function"."""
    name: str
    """`path` for a module, `path:Outer.name` for a class or function."""
    lines: int


def files() -> list[Path]:
    return sorted(p for tree in TREES for p in (ROOT / tree).rglob("*.py") if "__pycache__" not in p.parts)


def seams(path: Path, root: Path = ROOT) -> Iterator[Seam]:
    """The module, and every class and function in it (methods and nested ones named by their owners)."""
    text = path.read_text()
    relative = str(path.relative_to(root))
    yield Seam("module", relative, len(text.splitlines()))
    yield from _within(ast.parse(text), relative, "")


def _within(node: ast.AST, relative: str, prefix: str) -> Iterator[Seam]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            kind = "class" if isinstance(child, ast.ClassDef) else "function"
            name = f"{prefix}{child.name}"
            yield Seam(kind, f"{relative}:{name}", (child.end_lineno or child.lineno) - child.lineno + 1)
            yield from _within(child, relative, f"{name}.")
        else:
            yield from _within(child, relative, prefix)


def measure() -> list[Seam]:
    return [seam for path in files() for seam in seams(path)]


def over_caps(measured: list[Seam]) -> dict[str, int]:
    """`name` → lines of every seam over its cap."""
    return {s.name: s.lines for s in measured if s.lines > CAPS[s.kind]}


def main() -> int:
    measured = measure()
    modules = sorted((s for s in measured if s.kind == "module"), key=lambda s: s.lines)
    print("largest modules:")
    for seam in modules[-10:]:
        print(f"  {seam.lines:5d}  {seam.name}")
    for kind in ("class", "function"):
        over = sorted((s for s in measured if s.kind == kind and s.lines > CAPS[kind]), key=lambda s: -s.lines)
        print(f"{'classes' if kind == 'class' else 'functions'} over {CAPS[kind]} lines: {len(over)}")
        for seam in over:
            print(f"  {seam.lines:5d}  {seam.name}")
    sizes = sorted(s.lines for s in measured if s.kind == "function")
    deciles = statistics.quantiles(sizes, n=10)
    print(f"functions: {len(sizes)}, median {statistics.median(sizes):.0f} lines, p90 {deciles[8]:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
