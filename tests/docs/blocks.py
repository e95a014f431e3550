"""The fenced code blocks of the docs, and the checks run on them (tests/docs/test_code_blocks.py).

A shell block's `dyn ...` commands are parsed by the real click commands (never invoked): an unknown command
or option fails. A `python benchmarks/x.py ...` command's flags must appear in the script's `--help`. A python
block must compile. Shell variables (`$X`, `${X}`) and `<placeholders>` stand for values: they are accepted
wherever a value goes.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SHELL = {"bash", "sh", "shell"}
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
_PLACEHOLDER = re.compile(r"<[A-Za-z][\w./:@=-]*>")
_HEREDOC = re.compile(r"<<-?\s*['\"]?(\w+)['\"]?")
_SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")", ";;", "|&"}
_PREFIXES = {"time", "nohup", "exec", "sudo", "env"}


@dataclass(frozen=True, slots=True)
class Block:
    """One fenced code block: where it starts (the line after its opening fence), its language, its text."""

    path: Path
    line: int
    lang: str
    text: str


@dataclass(frozen=True, slots=True)
class Problem:
    """What is wrong with a command or a block, and where."""

    path: Path
    line: int
    message: str

    def __str__(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}: {self.message}"


def doc_files(root: Path = ROOT) -> list[Path]:
    """docs/**/*.md (docs/benchmarks is a link to benchmarks/: every *.md there but in out/), and README.md."""
    docs = [p for p in (root / "docs").rglob("*.md") if "benchmarks" not in p.relative_to(root / "docs").parts]
    benchmarks = [p for p in (root / "benchmarks").rglob("*.md") if "out" not in p.relative_to(root).parts]
    return sorted({*docs, *benchmarks, root / "README.md"})


def fenced_blocks(path: Path) -> Iterator[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, indent, start = opening["fence"], len(opening["indent"]), i + 1
        end = start
        while end < len(lines) and not lines[end].strip().startswith(fence[0] * len(fence)):
            end += 1
        body = [line[indent:] if not line[:indent].strip() else line.lstrip() for line in lines[start:end]]
        yield Block(path, start + 1, opening["lang"].lower(), "\n".join(body))
        i = end + 1


def shell_commands(block: Block) -> Iterator[tuple[int, list[str]]]:
    """(line, words) of each simple command of a shell block: `\\` continuations joined, comments, heredoc
    bodies and redirections dropped, split on `&&`, `||`, `;`, `|` and `&`."""
    lines = block.text.splitlines()
    i = 0
    while i < len(lines):
        first, text = i, lines[i]
        while text.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text.rstrip()[:-1] + " " + lines[i]
        i += 1
        heredoc = _HEREDOC.search(text)
        if heredoc is not None:
            while i < len(lines) and lines[i].strip() != heredoc[1]:
                i += 1
            i += 1
            text = text[: heredoc.start()]
        for words in _split(text.strip().removeprefix("$ ")):
            yield block.line + first, words


def _split(text: str) -> Iterator[list[str]]:
    text = _PLACEHOLDER.sub(lambda m: "$" + re.sub(r"\W", "_", m[0][1:-1]), text)
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # an unclosed quote: not a command line (prose in a shell block)
        return
    words: list[str] = []
    skip = False
    for token in tokens:
        if skip:
            skip = False
        elif token in _SEPARATORS:
            yield from _command(words)
            words = []
        elif set(token) <= set("<>&") and token:  # a redirection: it and its target go
            if words and words[-1].isdigit():
                words.pop()
            skip = True
        else:
            words.append(token)
    yield from _command(words)


def _command(words: list[str]) -> Iterator[list[str]]:
    while words and (re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]) or words[0] in _PREFIXES):
        words = words[1:]  # VAR=value and `time`-like prefixes
    if words:
        yield _usage_marks_dropped(words)


def _usage_marks_dropped(words: list[str]) -> list[str]:
    """`[--opt value]` is usage notation (an optional part): its words are checked without the brackets."""
    kept, is_optional = [], False
    for word in words:
        if word.startswith("[-"):
            word, is_optional = word[1:], True
        if is_optional and word.endswith("]"):
            word, is_optional = word[:-1], False
        kept.append(word)
    return kept


##### Checks #####


def is_placeholder(word: str) -> bool:
    return "$" in word


@functools.cache
def dyn_command() -> Any:
    """A private copy of `dyn`'s click command tree, its parameter callbacks removed (parsing must not act:
    `--install-completion` would)."""
    import typer

    from dynamo_cli.cli import main

    main._register()
    root = typer.main.get_command(main.app)
    stack = [root]
    while stack:
        command = stack.pop()
        for param in command.params:
            param.callback = None
        stack.extend(getattr(command, "commands", {}).values())
    return root


def check_dyn(words: list[str]) -> str | None:
    """None if `dyn ARGS` parses, else why not (the click message, naming the bad option or command).
    A `...` stands for a value or for more arguments: either reading will do."""
    args = words[1:]
    if "..." not in args:
        return _check_args(args)
    as_value = _check_args(["$ELLIPSIS" if word == "..." else word for word in args])
    if as_value is None or _check_args([word for word in args if word != "..."]) is None:
        return None
    return as_value


def _check_args(args: list[str]) -> str | None:
    import typer
    import typer._click as click

    args = list(args)
    for _ in range(len(args) + 1):
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                _parse(dyn_command(), args)
            return None
        except (typer.Exit, click.exceptions.NoArgsIsHelpError):
            return None  # --help, or a group with no command: shows help
        except click.exceptions.BadParameter as exc:
            if not _fill_placeholder(args, exc.param):
                return exc.format_message()
        except click.exceptions.UsageError as exc:
            return exc.format_message()
    return "too many placeholders"


def _parse(root: Any, args: list[str]) -> None:
    command, ctx = root, root.make_context("dyn", args)
    while hasattr(command, "commands"):
        rest = [*getattr(ctx, "_protected_args", getattr(ctx, "protected_args", [])), *ctx.args]
        if not rest:
            return
        name, command, rest = command.resolve_command(ctx, rest)
        ctx = command.make_context(name, rest, parent=ctx)


def _fill_placeholder(args: list[str], param: Any) -> bool:
    """Put a value `param` accepts where `args` gives it a placeholder; False if it has none."""
    if param is None:
        return False
    sample = _sample(param)
    for i, word in enumerate(args):
        if not is_placeholder(word):
            continue
        if i > 0 and args[i - 1] in param.opts + param.secondary_opts:
            args[i] = sample
            return True
        opt, _, value = word.partition("=")
        if value and opt in param.opts:
            args[i] = f"{opt}={sample}"
            return True
        if param.param_type_name == "argument":
            args[i] = sample
            return True
    return False


def _sample(param: Any) -> str:
    choices = getattr(param.type_descriptor, "choices", None) or ()
    if choices:
        return str(next(iter(choices)))
    if param.default is not None and not callable(param.default) and not isinstance(param.default, list | tuple):
        return str(param.default)
    return "1"


@functools.cache
def script_help(script: str) -> str:
    """`python SCRIPT --help`'s output (run once per script)."""
    done = subprocess.run(
        [sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    return done.stdout + done.stderr


def check_benchmark(words: list[str]) -> str | None:
    """None if every `--flag` of `python benchmarks/x.py ...` is in the script's `--help`, else which is not."""
    script = words[1]
    if not (ROOT / script).is_file():
        return f"no script {script}"
    text = script_help(script)
    for word in words[2:]:
        flag = word.partition("=")[0]
        if " " in word:  # a quoted value, such as --dyn-flags '--x y'
            continue
        if flag.startswith("--") and flag != "--help" and not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
            return f"{script} has no option {flag} (see its --help)"
    return None


def check_block(block: Block) -> list[Problem]:
    """What is wrong with one block (nothing for a language not checked)."""
    if block.lang == "python":
        try:
            compile(block.text, f"{block.path}:{block.line}", "exec")
        except SyntaxError as exc:
            return [Problem(block.path, block.line + (exc.lineno or 1) - 1, f"python block: {exc.msg}")]
        return []
    if block.lang not in SHELL:
        return []
    problems = []
    for line, words in shell_commands(block):
        why = None
        if words[0] == "dyn":
            why = check_dyn(words)
        elif words[0] in ("python", "python3") and len(words) > 1 and words[1].startswith("benchmarks/"):
            why = check_benchmark(words)
        if why is not None:
            problems.append(Problem(block.path, line, f"{shlex.join(words)}: {why}"))
    return problems


def check_file(path: Path) -> list[Problem]:
    return [problem for block in fenced_blocks(path) for problem in check_block(block)]
