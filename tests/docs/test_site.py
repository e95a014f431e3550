"""The docs site builds with `mkdocs build --strict`: a broken link or anchor, or a page left out of the
nav, is a warning, and a warning fails."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.docs.blocks import ROOT

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def test_the_site_builds_without_a_warning(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "NO_COLOR": "1"}  # no banner: only mkdocs' own lines
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    lines = [_ANSI.sub("", line) for line in done.stderr.splitlines()]
    warnings = [line for line in lines if line.startswith(("WARNING", "ERROR"))]
    assert done.returncode == 0 and not warnings, "\n".join(warnings) or "\n".join(lines[-40:])


def test_the_readme_is_a_front_door_whose_links_resolve() -> None:
    """At most 150 lines (the details live on the site), and every relative link names a file of the repo."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    targets = {m for m in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text) if "://" not in m}
    assert targets, "the README links into the docs"
    assert not [t for t in sorted(targets) if not (ROOT / t).exists()]
