"""The code blocks of the docs, README.md and benchmarks/*.md: `dyn` commands parse on the real CLI, a
benchmark script has the flags it is shown with (in its `--help`), python compiles (tests/docs/blocks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.blocks import ROOT, check_file, doc_files


def _page(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    return page


def test_a_wrong_flag_of_a_dyn_command_is_reported_with_its_file_line_and_flag(tmp_path: Path) -> None:
    page = _page(tmp_path, "# Page\n\n```bash\n# start it\ndyn serve --engine mocker \\\n  --no-such-flag\n```\n")
    problems = [str(problem) for problem in check_file(page)]
    assert problems == [f"{page}:5: dyn serve --engine mocker --no-such-flag: No such option: --no-such-flag"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        pytest.param("dyn sreve", "No such command 'sreve'", id="unknown-command"),
        pytest.param("dyn plan run --no-such-flag 1", "No such option: --no-such-flag", id="nested-command"),
        pytest.param("cd x && dyn ls --bogus | head", "No such option: --bogus", id="after-and-before-a-pipe"),
        pytest.param("python benchmarks/engine_vllm.py --no-rounds 3", "has no option --no-rounds", id="benchmark"),
    ],
)
def test_a_wrong_command_line_is_reported(tmp_path: Path, line: str, message: str) -> None:
    problems = check_file(_page(tmp_path, f"```sh\n{line}\n```\n"))
    assert len(problems) == 1
    assert message in problems[0].message


def test_variables_placeholders_and_usage_notation_stand_for_values(tmp_path: Path) -> None:
    lines = [
        "DYN_LOG_LEVEL=INFO dyn serve --port $PORT --workers ${N} --model <path> > log.txt 2>&1 &",
        "dyn bench --url ... --concurrency=$C [--isl 200] --json out.json",
        "dyn worker --engine mocker ...",
        "dyn serve --help",
        "cat <<EOF\ndyn not-a-command\nEOF",
    ]
    assert check_file(_page(tmp_path, "```bash\n" + "\n".join(lines) + "\n```\n")) == []


def test_a_quoted_value_that_holds_flags_is_a_value(tmp_path: Path) -> None:
    good = "python benchmarks/mocker_live.py --rounds 3 --dyn-flags '--disagg-first-token with-decode'"
    assert check_file(_page(tmp_path, f"```bash\n{good}\n```\n")) == []
    problems = check_file(_page(tmp_path, f"```bash\n{good} --no-rounds 2\n```\n"))
    assert [problem.message.split(": ")[-1] for problem in problems] == [
        "benchmarks/mocker_live.py has no option --no-rounds (see its --help)"
    ]


def test_a_python_block_that_does_not_compile_is_reported(tmp_path: Path) -> None:
    problems = check_file(_page(tmp_path, "text\n\n```python\nx = 1\nif x\n    pass\n```\n"))
    assert [(problem.line, problem.message) for problem in problems] == [(5, "python block: expected ':'")]


def test_blocks_of_other_languages_are_not_checked(tmp_path: Path) -> None:
    page = _page(tmp_path, "```text\ndyn sreve\n```\n\n```console\n$ dyn --bogus\n```\n")
    assert check_file(page) == []


@pytest.mark.parametrize("path", doc_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_every_code_block_of_the_docs_is_valid(path: Path) -> None:
    problems = check_file(path)
    assert not problems, "\n".join(map(str, problems))
