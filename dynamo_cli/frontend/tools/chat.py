"""One chat request's tool and format handling, decided before dispatch: the prompt text, the engine's
constraint and the `ChatOutput` that reads the response (None when the text passes through as is)."""

from __future__ import annotations

from dataclasses import dataclass

from dynamo_cli.frontend.guided import plan_tools
from dynamo_cli.frontend.openai import ChatCompletionRequest
from dynamo_cli.frontend.tools.output import ChatOutput
from dynamo_cli.frontend.tools.parsers import tool_parser
from dynamo_cli.frontend.tools.render import render_inputs
from dynamo_cli.model.tokenizer import Tokenizer
from dynamo_cli.model_card import ModelCard
from dynamo_cli.wire import Guided


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """What `prepare_chat` decided."""

    prompt: str
    """The rendered prompt text."""
    guided: Guided | None
    """Constrained decoding for the engine; None: free text."""
    output: ChatOutput | None
    """Reads the response into reasoning, content and tool calls; None: content as is."""


def prepare_chat(
    request: ChatCompletionRequest,
    card: ModelCard,
    tokenizer: Tokenizer,
    parser_name: str,
    reasoning: str | None,
    *,
    add_generation_prompt: bool = True,
) -> ChatPlan:
    """Check the request's tool fields against the model's card, render the prompt, build the reader."""
    plan = plan_tools(request, card.features, card.engine, card.display_name)
    template = tokenizer.template
    parser = tool_parser(parser_name, template.source if template is not None else "")
    messages, tools = render_inputs(request.messages, plan.tools, plan.mode, plan.named, parser, template)
    prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    output = None
    reasoning = None if plan.guided is not None else reasoning  # the grammar leaves no room for <think> text
    if plan.mode != "none" or reasoning:
        output = ChatOutput(plan.mode, parser, reasoning, plan.named)
    return ChatPlan(prompt, plan.guided, output)
