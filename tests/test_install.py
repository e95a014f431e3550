"""Install drift: every dependency range is bounded above, and the constraints file pins each one."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_NAME = re.compile(r"^([A-Za-z0-9_.-]+)")


def _requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [req for group in project["optional-dependencies"].values() for req in group]
    return [*project["dependencies"], *extras]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_dependency_has_an_upper_bound() -> None:
    unbounded = [req for req in _requirements() if "<" not in req and "==" not in req]
    assert unbounded == []


def test_the_constraints_file_pins_every_default_and_dev_dependency() -> None:
    pinned = {
        _norm(line.split("==")[0]) for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line
    }
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = project["optional-dependencies"]
    wanted = [*project["dependencies"], *groups["dev"], *groups["llamacpp"]]
    names = {_norm(match.group(1)) for req in wanted if (match := _NAME.match(req))}
    assert sorted(names - pinned) == []


def test_make_setup_and_ci_install_through_the_constraints_file() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "CONSTRAINTS := -c constraints.txt" in makefile
    setup = makefile.split("\nsetup:")[1].split("\n\n")[0]
    assert "$(CONSTRAINTS)" in setup
    assert "make setup" in (ROOT / ".ci" / "run").read_text()
