"""The one error of the llama.cpp engine: llama.cpp refused an operation."""

from __future__ import annotations

from dynamo_cli.errors import DynError


class LlamaCppError(DynError):
    """llama.cpp refused an operation (load, decode, state import)."""

    def __init__(self, what: str, code: int | None = None) -> None:
        self.what = what
        self.code = code
        suffix = f" (llama.cpp returned {code})" if code is not None else ""
        super().__init__(f"llama.cpp: {what}{suffix}")
