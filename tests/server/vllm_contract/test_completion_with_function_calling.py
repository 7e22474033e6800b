"""vLLM's tests/entrypoints/openai/chat_completion/test_completion_with_function_calling.py on
the tiny Qwen3 server (its line's parsers: hermes tool calls, qwen3 reasoning). A random model
calls tools only when `tool_choice` forces it, so `auto` is checked for protocol here and for
real calls on the scripted line (test_reasoning_and_tool_calls.py)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 4, "default": "Vienna"},
        "country": {"type": "string", "maxLength": 4},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "options": {"$ref": "#/$defs/WeatherOptions"},
    },
    "required": ["country", "unit"],
    "additionalProperties": False,
    "$defs": {"WeatherOptions": {"type": "object", "additionalProperties": False,
                                 "properties": {"include_forecast": {"type": "boolean"}}}},
}  # fmt: skip
FORECAST = {
    "type": "object",
    "properties": {"country": {"type": "string", "maxLength": 4},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["country", "days", "unit"],
    "additionalProperties": False,
}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_current_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_forecast", "parameters": FORECAST}},
]
SCHEMAS = {"get_current_weather": WEATHER, "get_forecast": FORECAST}
MESSAGES = [
    {"role": "user", "content": "Hi! How are you doing today?"},
    {"role": "assistant", "content": "I'm doing well! How can I help you?"},
    {"role": "user", "content": "What is the weather in Berlin and the forecast for 5 days?"},
]
NAMED = {"type": "function", "function": {"name": "get_current_weather"}}


def calls_of(client, server, stream: bool, **kwargs) -> tuple[list[tuple[str, str]], str]:
    """The answer's tool calls as (name, arguments) and its finish reason."""
    kwargs = dict(model=server.model, messages=MESSAGES, tools=TOOLS, **kwargs)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return calls, choice.finish_reason
    streamed: dict[int, list[str]] = {}
    reasons = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        assert choice.delta.role in (None, "assistant")
        for call in choice.delta.tool_calls or []:
            entry = streamed.setdefault(call.index, [call.function.name, ""])
            entry[1] += call.function.arguments or ""
        reasons.append(choice.finish_reason)
    assert len([reason for reason in reasons if reason]) == 1 and reasons[-1]
    return [(name, arguments) for name, arguments in streamed.values()], reasons[-1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_function_tool_use(client, server, stream, tool_choice):
    """test_function_tool_use: "required" answers calls of the offered tools whose arguments
    validate against the tool's schema ($defs included), finish_reason tool_calls, streamed or
    not; auto answers in the same protocol (a few tokens: a random model calls nothing). Its
    named-function case is test_named_tool_use's. vLLM's enable_thinking axis is folded in: on
    for whole answers, off for streams (the reasoning is test_reasoning_and_tool_calls.py's)."""
    calls, reason = calls_of(
        client, server, stream, tool_choice=tool_choice, seed=1,
        max_tokens=8 if tool_choice == "auto" else 120,
        extra_body={"chat_template_kwargs": {"enable_thinking": not stream}},
    )  # fmt: skip
    if tool_choice == "auto":
        assert reason in ("stop", "length", "tool_calls")
        return
    assert calls and reason == "tool_calls"
    for name, arguments in calls:
        assert name in SCHEMAS
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("arguments", ["{}", ""])
def test_no_args_tool_call(client, server, arguments):
    """test_no_args_tool_call: a call of a tool without parameters, its result in a `tool`
    message, then an answer; the call's arguments as `{}` or empty."""
    no_parameters = {"type": "object", "properties": {}, "required": [],
                     "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function",
              "function": {"name": "get_current_time", "parameters": no_parameters}}]  # fmt: skip
    messages = [{"role": "user", "content": "What time is it now?"}]
    shared = dict(model=server.model, temperature=0.0, seed=42,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    reply = client.chat.completions.create(
        messages=messages, tools=tools, tool_choice="required", max_tokens=40, **shared
    )
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_current_time"
    assert json.loads(call.function.arguments) == {}
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": arguments}}]})  # fmt: skip
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "2025-01-01T12:00"})
    final = client.chat.completions.create(
        messages=messages, tools=tools, max_completion_tokens=16, **shared
    )
    assert final.choices[0].message.content or final.choices[0].message.tool_calls


def test_named_tool_use(client, server):
    """test_named_tool_use: a named function's arguments validate against its schema; content
    is empty; streamed, no content at all, role assistant, one finish_reason, and the argument
    pieces join to valid JSON."""
    tools = [{"type": "function", "function": {"name": "dummy_function_name",
                                               "parameters": FORECAST}}]  # fmt: skip
    choice = {"type": "function", "function": {"name": "dummy_function_name"}}
    kwargs = dict(model=server.model, max_completion_tokens=100, tools=tools, tool_choice=choice,
                  temperature=0.0)  # fmt: skip
    messages = [{"role": "user", "content": "Give an example forecast using the tool."}]
    message = client.chat.completions.create(messages=messages, **kwargs).choices[0].message
    assert not message.content
    jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), FORECAST)

    pieces, reasons = [], []
    for chunk in client.chat.completions.create(messages=messages, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        assert delta.role in (None, "assistant")
        assert not delta.content
        if delta.tool_calls and delta.tool_calls[0].function.arguments:
            pieces.append(delta.tool_calls[0].function.arguments)
        reasons.append(chunk.choices[0].finish_reason)
    assert len([reason for reason in reasons if reason]) == 1
    streamed = json.loads("".join(pieces))
    jsonschema.validate(streamed, FORECAST)
    assert streamed == json.loads(message.tool_calls[0].function.arguments)  # greedy both times


@pytest.mark.parametrize(
    ("tools", "tool_choice"),
    [
        (None, {"type": "function", "function": {"name": "dummy_function_name"}}),
        (TOOLS, {"type": "function", "function": {"name": "nondefined_function_name"}}),
        (TOOLS, {}),
    ],
    ids=["no-tools", "unknown-name", "empty"],
)
def test_inconsistent_tool_choice_and_tools(client, server, tools, tool_choice):
    """test_inconsistent_tool_choice_and_tools: a named choice without tools, naming a tool
    not offered, or an empty object, is a 400."""
    kwargs = {} if tools is None else {"tools": tools}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=server.model, messages=MESSAGES, max_completion_tokens=10,
            tool_choice=tool_choice, **kwargs,
        )  # fmt: skip


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_max_tokens_with_tool_choice_required(client, server, tool_choice):
    """test_max_tokens_with_tool_choice_required: one token cannot hold a call; the answer ends
    by length with no tool_calls, as OpenAI answers."""
    choice = client.chat.completions.create(
        model=server.model, messages=MESSAGES, temperature=0, max_completion_tokens=1,
        tools=TOOLS, tool_choice=tool_choice,
    ).choices[0]  # fmt: skip
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is None
