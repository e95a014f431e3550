"""Fixtures of the mocker's engine tests."""

from pathlib import Path

import pytest


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    """An empty model directory: the mocker loads nothing, the name is the model's."""
    path = tmp_path / "mock-model"
    path.mkdir()
    return str(path)
