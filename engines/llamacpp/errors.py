"""The one error of the llama.cpp engine: llama.cpp refused an operation."""

from __future__ import annotations

from dynamo_cli.errors import DynError


class LlamaCppError(DynError):
    """llama.cpp refused an operation (load, decode, state import)."""

    def __init__(self, what: str, returned: int | None = None) -> None:
        self.what = what
        self.returned = returned
        """llama.cpp's return code (not `code`: that is the OpenAI error code every DynError has)."""
        suffix = f" (llama.cpp returned {returned})" if returned is not None else ""
        super().__init__(f"llama.cpp: {what}{suffix}")
