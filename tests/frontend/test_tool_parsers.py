"""Tool-call parsers, the jailed stream and the reasoning splitter on model outputs in each family's
published format, whole and streamed at every chunk size (so markers split at awkward boundaries)."""

from __future__ import annotations

import json

import pytest

from dynamo_cli.errors import ConfigError
from dynamo_cli.frontend.tools.output import ChatOutput
from dynamo_cli.frontend.tools.parsers import PARSERS, ParsedCall, check_parsers, tool_parser
from dynamo_cli.frontend.tools.reasoning import ReasoningSplitter
from dynamo_cli.frontend.tools.stream_jail import ToolCallJail

WEATHER = ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = ParsedCall("get_time", '{"tz": "Europe/Paris"}')

# (parser, model output, content expected, calls expected): outputs in the shapes these families emit
# (Hermes 2 Pro / Qwen 2.5, Llama 3.1 JSON tool calling, Mistral v3 and v11 tokenizers, Llama 3.2 pythonic).
RECORDED = [
    (
        "hermes",
        'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
        "I will check.",
        [WEATHER, TIME],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        "",
        [WEATHER],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        "",
        [WEATHER],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
        "",
        [WEATHER, TIME],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
        "",
        [WEATHER, TIME],
    ),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', "Sure.", [WEATHER]),
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), get_time(tz="Europe/Paris")]', "", [WEATHER, TIME]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris", unit="celsius")]<|python_end|>', "", [WEATHER]),
    ("json", '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}', "", [WEATHER]),
    (
        "json",
        '```json\n[{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"unit\\": \\"celsius\\"}"}]\n```',
        "",
        [WEATHER],
    ),
]

NOT_CALLS = [
    ("hermes", "The weather tool needs a city. Which one?"),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": '),  # cut by max_tokens
    ("llama3_json", "{ not json at all"),
    ("mistral", "[TOOL_CALLS] nonsense"),
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "Lists look like [a, b]."),
    ("json", '{"city": "Paris"}'),  # JSON, but not a call
    ("json", "Plain text answer."),
]


def streamed(parser: str, text: str, size: int) -> tuple[str, list[ParsedCall]]:
    jail = ToolCallJail(tool_parser(parser))
    out = "".join(jail.push(text[i : i + size]) for i in range(0, len(text), size))
    rest, calls = jail.finish()
    return out + rest, calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), RECORDED)
def test_each_parser_reads_its_familys_calls_whole_and_streamed_at_any_chunk_size(
    parser: str, text: str, content: str, calls: list[ParsedCall]
) -> None:
    assert tool_parser(parser).parse(text) == (content, calls)
    for size in (1, 2, 3, 5, 7, 13, len(text)):
        got_content, got_calls = streamed(parser, text, size)
        assert got_calls == calls, size
        assert got_content.strip() == content, size


@pytest.mark.parametrize(("parser", "text"), NOT_CALLS)
def test_text_that_is_not_a_call_comes_back_whole_as_content(parser: str, text: str) -> None:
    assert tool_parser(parser).parse(text) == (text, [])
    for size in (1, 4, len(text)):
        assert streamed(parser, text, size) == (text, [])


def test_content_before_a_marker_streams_before_the_call_and_a_partial_marker_is_held() -> None:
    jail = ToolCallJail(tool_parser("hermes"))
    assert jail.push("Checking the weather <tool") == "Checking the weather "
    assert jail.push('_call>{"name": "get_weather", "arguments": {}}') == ""
    assert jail.finish() == ("", [ParsedCall("get_weather", "{}")])
    plain = ToolCallJail(tool_parser("hermes"))
    assert plain.push("a <to") == "a " and plain.push("y>") == "<toy>" and plain.finish() == ("", [])


def test_a_hermes_call_goes_out_at_its_end_marker_and_text_after_it_flows_again() -> None:
    jail = ToolCallJail(tool_parser("hermes"))
    assert jail.push('<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool') == ""
    assert jail.take() == []
    assert jail.push("_call>\nThen ") == "" and jail.take() == [TIME]  # released before the output ends
    assert jail.push("I will summarise.") == "\nThen I will summarise."
    assert jail.push(' <tool_call>{"name": "get_weather"') == " " and jail.take() == []
    assert jail.finish() == ('<tool_call>{"name": "get_weather"', [])  # cut short: back as text
    output = ChatOutput("auto", tool_parser("hermes"))
    text = RECORDED[0][1] + "\nDone."
    deltas = [d for ch in text for d in output.push(ch)] + output.finish()
    kinds = [next(iter(d)) for d in deltas]
    first_call = kinds.index("tool_calls")
    assert "tool_calls" not in kinds[:first_call] and kinds[-1] == "content"  # text, calls, then text again
    assert assemble(deltas)["content"] == "I will check.\n\n\nDone."


def test_leading_markers_open_a_call_only_at_the_start() -> None:
    jail = ToolCallJail(tool_parser("json"))
    assert jail.push("The set ") == "The set " and jail.push("{1, 2}") == "{1, 2}"
    assert jail.finish() == ("", [])


def test_calls_are_rendered_back_in_the_format_each_parser_reads() -> None:
    for name, parser_cls in PARSERS.items():
        parser = parser_cls()
        assert parser.parse(parser.render([WEATHER, TIME]))[1] == [WEATHER, TIME], name


def test_auto_picks_the_parser_from_the_template_and_names_are_checked() -> None:
    assert tool_parser("auto", "{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert tool_parser("auto", "<|python_tag|>").name == "llama3_json"
    assert tool_parser("auto", "{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert tool_parser("auto", "").name == "json"
    with pytest.raises(ConfigError, match="nope"):
        check_parsers("nope", None)
    with pytest.raises(ConfigError, match="deepthink"):
        check_parsers("auto", "deepthink")


##### Reasoning #####

THINK = "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is 4."


@pytest.mark.parametrize(
    ("name", "text", "reasoning", "content"),
    [
        ("basic", THINK, "\nThe user wants 2+2. That is 4.\n", "The answer is 4."),
        ("basic", "No thinking here.", "", "No thinking here."),
        ("qwen3", THINK, "\nThe user wants 2+2. That is 4.\n", "The answer is 4."),
        ("deepseek_r1", "The user wants 2+2.\n</think>\n\nIt is 4.", "The user wants 2+2.\n", "It is 4."),
        ("deepseek_r1", THINK, "\nThe user wants 2+2. That is 4.\n", "The answer is 4."),
        ("deepseek_r1", "Still thinking when max_tokens hit", "Still thinking when max_tokens hit", ""),
    ],
)
def test_reasoning_is_split_from_the_answer_whole_and_streamed(
    name: str, text: str, reasoning: str, content: str
) -> None:
    assert ReasoningSplitter(name).split(text) == (reasoning, content)
    for size in (1, 2, 3, 6, 11):
        splitter = ReasoningSplitter(name)
        parts = [splitter.push(text[i : i + size]) for i in range(0, len(text), size)] + [splitter.flush()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (reasoning, content), size


##### ChatOutput: what the client gets #####


def assemble(deltas: list[dict[str, object]]) -> dict[str, object]:
    """Accumulate deltas as the openai client's stream helpers do."""
    out: dict[str, object] = {"content": "", "reasoning_content": "", "tool_calls": {}}
    calls: dict[int, dict[str, str]] = out["tool_calls"]  # type: ignore[assignment]
    for delta in deltas:
        out["content"] = str(out["content"]) + str(delta.get("content", ""))
        out["reasoning_content"] = str(out["reasoning_content"]) + str(delta.get("reasoning_content", ""))
        for call in delta.get("tool_calls", []):  # type: ignore[attr-defined]
            slot = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
            if "id" in call:
                assert not slot["id"] and call["type"] == "function" and call["function"]["arguments"] == ""
                slot["id"], slot["name"] = call["id"], call["function"]["name"]
            else:
                assert slot["id"], "arguments before the call's header"
            slot["arguments"] += call["function"].get("arguments", "")
    return out


def test_streamed_auto_output_with_reasoning_assembles_to_the_whole_message() -> None:
    text = "<think>Need the weather.</think>" + RECORDED[0][1]
    for size in (1, 3, 8, len(text)):
        output = ChatOutput("auto", tool_parser("hermes"), "basic")
        deltas = [d for i in range(0, len(text), size) for d in output.push(text[i : i + size])] + output.finish()
        got = assemble(deltas)
        assert got["reasoning_content"] == "Need the weather." and str(got["content"]).strip() == "I will check."
        calls = got["tool_calls"]
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (WEATHER.name, WEATHER.arguments),  # type: ignore[attr-defined]
            (TIME.name, TIME.arguments),
        ]
        assert output.finish_reason("stop") == "tool_calls" and output.finish_reason("length") == "length"
    message = ChatOutput("auto", tool_parser("hermes"), "basic").message(text)
    assert message["content"] == "I will check." and message["reasoning_content"] == "Need the weather."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    assert len({c["id"] for c in message["tool_calls"]}) == 2


def test_required_and_named_outputs_become_calls() -> None:
    required = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}]'
    output = ChatOutput("required", tool_parser("json"))
    deltas = [d for ch in required for d in output.push(ch)]
    assert deltas == []  # jailed to the end
    got = assemble(output.finish())
    assert [(c["name"], c["arguments"]) for c in got["tool_calls"].values()] == [(WEATHER.name, WEATHER.arguments)]  # type: ignore[attr-defined]
    named = ChatOutput("named", tool_parser("json"), named="get_weather")
    deltas = [d for ch in WEATHER.arguments for d in named.push(ch)] + named.finish()
    assert len(deltas) == len(WEATHER.arguments) + 1  # the header, then the arguments as they come
    assert json.loads(assemble(deltas)["tool_calls"][0]["arguments"]) == {"city": "Paris", "unit": "celsius"}  # type: ignore[index]
    cut = ChatOutput("required", tool_parser("json")).message('[{"name": "get_weather", "param')
    assert cut == {"role": "assistant", "content": '[{"name": "get_weather", "param'}
