"""`--backend-file`'s reading: one `--backend` a line, comments and repeats left out, a bad line named by number."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynamo_cli.backend_file import MAX_FILE_BYTES, read_backends
from dynamo_cli.config import backend_options
from dynamo_cli.errors import ConfigError


def test_the_lines_are_the_backends_in_order_each_once(tmp_path: Path) -> None:
    listed = tmp_path / "b.txt"
    listed.write_text(
        "# fleet\n\nhttp://a:8000\n  http://b:8000,kv_events=tcp://b:5557  # with events\nhttp://a:8000\n"
    )
    assert read_backends(listed) == ["http://a:8000", "http://b:8000,kv_events=tcp://b:5557"]
    assert backend_options(read_backends(listed)[1]) == {"url": "http://b:8000", "kv_events": "tcp://b:5557"}


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("http://a:1\nftp://b\n", "line 2: .*http\\(s\\)://HOST"),
        ("http://a:1,kv_events\n", "line 1: .*KEY=VALUE"),
        ("http://a:1,url=http://b:2\n", "line 1: .*KEY=VALUE"),
        ("x" * (MAX_FILE_BYTES + 1), "over 1048576 bytes"),
    ],
)
def test_a_file_that_is_not_one_is_refused_naming_it(tmp_path: Path, text: str, words: str) -> None:
    listed = tmp_path / "b.txt"
    listed.write_text(text)
    with pytest.raises(ConfigError, match=f"--backend-file {listed}.*{words}"):
        read_backends(listed)


def test_a_missing_file_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--backend-file .*nothing.txt: No such file"):
        read_backends(tmp_path / "nothing.txt")
