"""A served tiny GLM-5 checkpoint with the line's own parsers (glm45, glm47) and its chat
template: a conversation with tools, calls and their results renders in GLM-5's layout, and
its random model, held to a grammar of GLM's tags by tool_choice, answers with a call the
glm47 parser reads back, values typed by the tool's schema."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pegainfer.core.text.tokenizer import Tokenizer
from pegainfer.core.tiny import main as tiny_main
from tests.server.conftest import start_server, stop_server
from tests.server.test_scripted_line import ask

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string", "enum": ["Beijing", "Paris"]},
            "days": {"type": "integer", "enum": [1, 2, 3]}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
]  # fmt: skip


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-glm5-tools")
    assert tiny_main(["glm5", str(root / "model")]) == 0
    server = start_server(root / "model", root / "server.log", "--max-model-len", "1024")
    yield server, openai.OpenAI(base_url=server.base_url, api_key="none")
    stop_server(server)


def test_a_tool_round_trip_renders_in_glm5s_layout(glm):
    server, client = glm
    arguments = '{"city": "Paris", "days": 2}'
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = {"model": server.model, "messages": messages, "tools": TOOLS}
    tokens = httpx.post(f"{server.url}/tokenize", json=body).json()
    text = Tokenizer.from_dir(server.model).decode(tokens["tokens"], skip_special_tokens=False)
    assert text.startswith("[gMASK]<sop><|system|>")
    assert text.endswith(
        "<|user|>Weather in Paris?<|assistant|></think><tool_call>get_weather<arg_key>city"
        "</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value>"
        "</tool_call><|observation|><tool_response>sunny</tool_response><|assistant|><think>"
    )
    reply = client.chat.completions.create(model=server.model, messages=messages, tools=TOOLS,
                                           max_tokens=4)  # fmt: skip
    assert reply.usage.prompt_tokens == tokens["count"]


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    ("tool_choice", "names", "stream", "thinking"),
    [(NAMED, {"get_weather"}, False, True),
     ("required", {"get_weather", "get_time"}, True, True),
     ("required", {"get_weather", "get_time"}, False, False)],
)  # fmt: skip
def test_forced_calls_come_back_as_tool_calls(glm, tool_choice, names, stream, thinking):
    server, client = glm
    messages = [{"role": "user", "content": "What is the weather in Beijing?"}]
    content, reasoning, calls, reason = ask(
        client, server, messages, stream, tools=TOOLS, tool_choice=tool_choice,
        parallel_tool_calls=False, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": thinking}},
    )  # fmt: skip
    assert (content, reasoning, reason) == (None, None, "tool_calls")
    [(name, arguments, call_id)] = calls
    assert name in names and call_id.startswith("call_")
    expected = {"get_weather": {"city": ["Beijing", "Paris"], "days": [1, 2, 3]},
                "get_time": {}}[name]  # fmt: skip
    assert arguments.keys() == expected.keys()
    assert all(arguments[k] in v for k, v in expected.items()), arguments


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_answer_is_content_not_thinking(glm, stream):
    """GLM-5 thinks from its answer's first token, but an answer held to a schema is the
    schema's JSON from its first token: it went to reasoning_content, content empty."""
    server, client = glm
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    kwargs = dict(model=server.model, messages=[{"role": "user", "content": "OK?"}], seed=1,
                  max_tokens=20, response_format={"type": "json_schema", "json_schema": {
                      "name": "ok", "schema": schema}})  # fmt: skip
    if stream:
        deltas = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kwargs)
                  if c.choices]  # fmt: skip
        content = "".join(d.content or "" for d in deltas)
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        content, reasoning = message.content, getattr(message, "reasoning_content", None)
    assert json.loads(content) in ({"ok": True}, {"ok": False}) and not reasoning
