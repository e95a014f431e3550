"""Install drift: every dependency range is bounded above, and the constraints file pins each one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

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


def test_make_runs_dyn_from_the_chosen_pythons_own_bin_with_no_venv_activated(tmp_path: Path) -> None:
    # `make demo PYTHON=venv/bin/python3` on a fresh machine: scripts/demo.sh and the tests run `dyn` by name
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python3").symlink_to(sys.executable)
    show = tmp_path / "show.mk"
    show.write_text("include Makefile\nshow-path:\n\t@echo $$PATH\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    args = ["make", "-s", "-f", str(show), "show-path", f"PYTHON={bin_dir / 'python3'}"]
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30, check=True).stdout
    assert out.strip().split(":")[0] == str(bin_dir)


def _setup_packages() -> tuple[list[str], dict[str, str]]:
    """The packages and package_dir setup.py hands setuptools (its `setup` call captured, nothing built)."""
    import setuptools

    captured: dict[str, Any] = {}
    source = (ROOT / "setup.py").read_text()
    original, setuptools.setup = setuptools.setup, lambda **kwargs: captured.update(kwargs)
    try:
        cwd = os.getcwd()
        os.chdir(ROOT)
        exec(compile(source, "setup.py", "exec"), {"__name__": "__main__"})
    finally:
        os.chdir(cwd)
        setuptools.setup = original
    return captured["packages"], captured["package_dir"]


def test_the_engines_folder_installs_under_an_import_name_of_its_own() -> None:
    packages, package_dir = _setup_packages()
    assert package_dir == {"dyn_engines": "engines"}
    assert not [p for p in packages if p.split(".")[0] not in ("dynamo_cli", "dyn_engines")]
    folders = sorted(p.parent.relative_to(ROOT).as_posix() for p in ROOT.glob("engines/**/__init__.py"))
    assert (
        sorted(p.replace("dyn_engines", "engines", 1).replace(".", "/") for p in packages if "engines" in p) == folders
    )
    assert sorted(p.replace(".", "/") for p in packages if p.startswith("dynamo_cli")) == sorted(
        p.parent.relative_to(ROOT).as_posix() for p in ROOT.glob("dynamo_cli/**/__init__.py")
    )


def test_every_engine_entry_point_names_a_module_of_the_installed_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    targets = project["entry-points"]["dyn.engines"]
    for name, target in targets.items():
        module = target.split(":")[0]
        assert module.startswith("dyn_engines."), (name, target)
        assert (ROOT / "engines" / Path(*module.split(".")[1:])).with_suffix(".py").is_file(), (name, target)
