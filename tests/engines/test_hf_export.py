"""GGUF → HF directory export for engines without a GGUF loader: cache keys, cache hits, missing libraries."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from dyn_engines.hf_export import MARKER, export_path, hf_model_dir, needs_export

from dynamo_cli.errors import ConfigError


def test_only_aliases_and_gguf_files_need_an_export(tmp_path: Path) -> None:
    assert needs_export("smollm2") and needs_export(str(tmp_path / "m.gguf"))
    assert not needs_export(str(tmp_path)) and not needs_export("Qwen/Qwen3-0.6B")
    assert hf_model_dir(str(tmp_path), root=tmp_path) == str(tmp_path)  # an HF directory passes through


def test_the_export_path_follows_the_file_and_changes_when_it_changes(tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF v1")
    first = export_path(gguf, tmp_path)
    assert first == export_path(gguf, tmp_path) and first.parent == tmp_path / "hf" and first.name.startswith("tiny-")
    os.utime(gguf, ns=(1, 1))
    assert export_path(gguf, tmp_path) != first  # a replaced file is exported again


def test_a_finished_export_is_reused_without_loading_anything(tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"not even a real GGUF")
    done = export_path(gguf, tmp_path)
    done.mkdir(parents=True)
    (done / MARKER).write_text("{}")
    assert hf_model_dir(str(gguf), root=tmp_path) == str(done)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is not None, reason="transformers is installed here")
def test_without_transformers_the_error_names_what_to_install(tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="pip install transformers accelerate"):
        hf_model_dir(str(gguf), root=tmp_path)
    assert not list((tmp_path / "hf").glob("tiny-*"))  # nothing half-written is left behind
