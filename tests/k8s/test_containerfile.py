"""The Containerfile that builds the image `dyn k8s render` names: it lints clean, pins its base, installs
through constraints.txt, runs unprivileged, accepts every engine pyproject.toml offers, and its build context
holds what the wheel is built from. No image is built here (no container runtime on these machines)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from dynamo_cli import __version__
from dynamo_cli.k8s.names import PORTS
from dynamo_cli.k8s.objects import UID

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "Containerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) of each instruction, continuation lines joined, comments left out."""
    logical: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip().removesuffix("\\") + (" " if line.rstrip().endswith("\\") else "")
        if not line.rstrip().endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            logical.append((word.upper(), rest.strip()))
            pending = ""
    return logical


STEPS = instructions(CONTAINERFILE.read_text())


def arg_default(name: str) -> str:
    """The default of `ARG name=...` (the first one; quotes removed)."""
    for word, rest in STEPS:
        key, sep, value = rest.partition("=")
        if word == "ARG" and key == name and sep:
            return value.strip('"')
    raise AssertionError(f"no ARG {name}=... in the Containerfile")


def engine_extras(engine: str) -> subprocess.CompletedProcess[str]:
    """Run the Containerfile's own ENGINE → extras `case` in bash for `engine`."""
    run = " ".join(rest for word, rest in STEPS if word == "RUN")
    case = re.search(r'case "\$ENGINE" in .*? esac', run)
    assert case is not None, 'no `case "$ENGINE" in ... esac` in a RUN'
    script = f'{case.group(0)}; echo "$extras"'
    return subprocess.run(["bash", "-c", script], env={"ENGINE": engine}, capture_output=True, text=True, timeout=10)


def test_hadolint_passes_on_the_containerfile() -> None:
    binary = shutil.which("hadolint")
    if binary is None:
        pytest.skip("hadolint is not installed (pip install 'dynamo-cli[dev]')")
    result = subprocess.run(
        [binary, "--no-color", "--config", str(ROOT / ".hadolint.yaml"), str(CONTAINERFILE)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolints_settings_fail_a_warning_such_as_a_root_user(tmp_path: Path) -> None:
    binary = shutil.which("hadolint")
    if binary is None:
        pytest.skip("hadolint is not installed (pip install 'dynamo-cli[dev]')")
    rooted = tmp_path / "Containerfile"
    rooted.write_text(CONTAINERFILE.read_text().replace(f"USER {UID}\n", "USER root\n"))
    result = subprocess.run(
        [binary, "--no-color", "--config", str(ROOT / ".hadolint.yaml"), str(rooted)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode != 0 and "DL3002" in result.stdout, result.stdout


def test_every_base_image_is_pinned_by_a_full_version_tag() -> None:
    stages = {rest.split()[-1] for word, rest in STEPS if word == "FROM" and " AS " in rest.upper()}
    bases = [rest.split()[0] for word, rest in STEPS if word == "FROM"]
    external = [image for image in bases if image not in stages]
    assert external, bases
    for image in external:
        name, _, tag = image.rpartition(":")
        assert name and "$" not in image, f"{image}: name the image and its tag, not a variable"
        assert re.match(r"^\d+\.\d+\.\d+-", tag), f"{image}: pin a full version tag (e.g. 3.11.14-slim-bookworm)"


def test_constraints_txt_is_copied_and_every_install_goes_through_it() -> None:
    assert any(word == "COPY" and "constraints.txt" in rest.split() for word, rest in STEPS)
    installs = [rest for word, rest in STEPS if word == "RUN" and re.search(r"pip (install|wheel)", rest)]
    assert len(installs) >= 2, installs  # the wheels built, then installed
    for run in installs:
        assert re.search(r"-c \S*constraints\.txt", run), run
        assert "--no-cache-dir" in run, run


def test_the_image_runs_unprivileged_as_the_rendered_pods_uid() -> None:
    users = [rest for word, rest in STEPS if word == "USER"]
    assert users and users[-1] == str(UID) and UID != 0, users
    assert dict(STEPS)["ENTRYPOINT"] == '["dyn"]'
    assert "HOME=/tmp" in " ".join(rest for word, rest in STEPS if word == "ENV")


def test_the_image_exposes_the_ports_the_manifests_use() -> None:
    exposed = {int(port) for word, rest in STEPS if word == "EXPOSE" for port in rest.split()}
    assert exposed == {PORTS.http, PORTS.request_plane, PORTS.system, PORTS.kv_transfer}


def test_the_version_and_llama_flags_are_pyprojects_and_the_makefiles() -> None:
    assert arg_default("VERSION") == PYPROJECT["project"]["version"] == __version__
    makefile = (ROOT / "Makefile").read_text()
    flags = re.search(r"^LLAMA_CMAKE_ARGS := (.*)$", makefile, re.M)
    assert flags is not None and arg_default("LLAMA_CMAKE_ARGS") == flags.group(1).strip()


@pytest.mark.parametrize("engine", sorted(PYPROJECT["project"]["entry-points"]["dyn.engines"]))
def test_every_engine_installs_its_extra_the_kubernetes_client_and_postgres(engine: str) -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    result = engine_extras(engine)
    assert result.returncode == 0, result.stderr
    chosen = set(result.stdout.strip().split(","))
    assert chosen == ({engine, "k8s", "postgres"} if engine in extras else {"k8s", "postgres"})
    assert chosen <= set(extras)


def test_an_unknown_engine_fails_the_build_naming_the_choices() -> None:
    result = engine_extras("llama")
    assert result.returncode != 0 and "ENGINE=llama" in result.stderr and "mocker" in result.stderr
    assert arg_default("ENGINE") in PYPROJECT["project"]["entry-points"]["dyn.engines"]


def test_the_build_context_holds_what_the_wheel_is_built_from(tmp_path: Path) -> None:
    ignore = (ROOT / ".containerignore").read_text().splitlines()
    assert (ROOT / ".dockerignore").read_text().splitlines() == ignore  # docker reads the other name
    assert "*" in ignore  # an allow-list: nothing reaches the builder unless named
    allowed = [line[1:].rstrip("/") for line in ignore if line.startswith("!")]
    copied = {src for word, rest in STEPS if word == "COPY" and "--from" not in rest for src in rest.split()[:-1]}
    assert copied <= set(allowed), copied - set(allowed)
    context = tmp_path / "context"
    for name in allowed:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, context / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            context.mkdir(exist_ok=True)
            shutil.copy(source, context / name)
    wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", "out", "."]
    result = subprocess.run(wheel, cwd=context, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    (built,) = (context / "out").glob("dynamo_cli-*.whl")
    names = zipfile.ZipFile(built).namelist()
    assert "dynamo_cli/cli/main.py" in names and "dyn_engines/mocker/engine.py" in names
