"""A model's Jinja chat template, rendered in a sandbox as Hugging Face does."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from jinja2 import TemplateError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dynamo_cli.errors import ConfigError, RequestError


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    """Compiled once; `render` turns OpenAI messages into the prompt text."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
            self.uses_tools = "tools" in meta.find_undeclared_variables(env.parse(source))
            """The template renders a `tools` list (else tools/render.py describes them in a system block)."""
        except TemplateError as exc:
            raise ConfigError(f"the model's chat template does not compile: {exc}") from exc
        self.source = source
        self._bos = bos_token
        self._eos = eos_token

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Prompt text for `messages`; a template that rejects them is the client's error (400)."""
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos,
                eos_token=self._eos,
                tools=tools,
            )
        except (TemplateError, TypeError) as exc:  # TypeError: a template adding None content to a string
            raise RequestError(f"the model's chat template rejected the messages: {exc}", param="messages") from exc
