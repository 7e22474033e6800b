"""GLM-5's chat format end to end through the server: the scripted line answers in GLM's text
(thinking closed by </think>, calls in <tool_call> tags), with the tiny GLM-5 tokenizer and
chat template, under the glm45/glm47 parsers; the openai SDK gets reasoning, tool_calls typed
by the tools' schemas (streamed in pieces), a round trip through the chat template, thinking on
and off, and tool_choice constrained to GLM's tags, streamed and not."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.conftest import start_server, stop_server
from tests.server.helpers import install_scripted_line
from tests.server.test_scripted_line import ask

pytestmark = pytest.mark.line("glm5")

CALL = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris, the city of light"
        "</arg_value><arg_key>zip</arg_key><arg_value>75001</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>")  # fmt: skip
ARGUMENTS = {"city": "Paris, the city of light", "zip": "75001", "days": 2}
SCRIPTS = [
    ["<tool_response>", "Got it.</think>It is sunny in Paris.", 0.02],
    ["Forced", CALL, 0.02],
    ["Weather", "I need the weather tool.</think>" + CALL, 0.02],
    ["", "Hello there."],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"},
                                     "days": {"type": "integer"}},
    "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}}]  # fmt: skip


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    from pegainfer.core.text.tokenizer import Tokenizer
    from pegainfer.models.glm5.tiny import write_tiny_glm5

    root = tmp_path_factory.mktemp("glm5-scripted")
    env = install_scripted_line(root / "plugin")
    model = root / "model"
    write_tiny_glm5(model, weights=False)  # GLM-5's tokenizer, template and end-of-turn tokens
    tokenizer = Tokenizer.from_dir(model)
    eos = tokenizer.token_to_id("<|observation|>")
    config = {"model_type": "scripted", "vocab_size": tokenizer.vocab_size, "eos_token_id": eos,
              "scripts": SCRIPTS}  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    server = start_server(model, root / "server.log", "--max-model-len", "2048",
                          "--reasoning-parser", "glm45", "--tool-call-parser", "glm47",
                          env=env)  # fmt: skip
    yield server, openai.OpenAI(base_url=server.base_url, api_key="none")
    stop_server(server)


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_round_trip(glm, stream):
    server, client = glm
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    content, reasoning, calls, reason = ask(client, server, messages, stream, tools=TOOLS)
    assert (content, reasoning, reason) == (None, "I need the weather tool.", "tool_calls")
    [(name, arguments, call_id)] = calls
    assert (name, arguments) == ("get_weather", ARGUMENTS) and call_id.startswith("call_")
    messages += [
        {"role": "assistant", "content": None, "reasoning_content": reasoning, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21C"},
    ]  # fmt: skip
    content, reasoning, calls, reason = ask(client, server, messages, stream, tools=TOOLS)
    assert (content, reasoning, calls, reason) == ("It is sunny in Paris.", "Got it.", [], "stop")


def test_arguments_stream_in_pieces(glm):
    server, client = glm
    stream = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=TOOLS, max_tokens=100, stream=True)  # fmt: skip
    deltas = [call for chunk in stream for call in chunk.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    pieces = [d.function.arguments for d in deltas[1:]]
    assert len(pieces) > 3 and all(d.id is None and d.index == 0 for d in deltas[1:])
    assert json.loads("".join(pieces)) == ARGUMENTS


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_on_and_off(glm, stream):
    server, client = glm
    messages = [{"role": "user", "content": "Hi"}]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert ask(client, server, messages, stream, extra_body=off)[:2] == ("Hello there.", None)
    # on by default (the template opened <think>): an answer that never closes it is reasoning
    content, reasoning, _, _ = ask(client, server, messages, stream)
    assert (content or None, reasoning) == (None, "Hello there.")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_calls_in_glms_format(glm, stream, tool_choice):
    server, client = glm
    messages = [{"role": "user", "content": "Forced weather"}]
    content, reasoning, calls, reason = ask(client, server, messages, stream, tools=TOOLS,
                                            tool_choice=tool_choice)  # fmt: skip
    assert (content, reasoning, reason) == (None, None, "tool_calls")
    assert [(name, arguments) for name, arguments, _ in calls] == [("get_weather", ARGUMENTS)]


@pytest.mark.parametrize(("arguments", "error"), [("{not json", "is not JSON"),
                                                  ("[1, 2]", "must be a JSON object")])  # fmt: skip
def test_history_arguments_must_be_a_json_object(glm, arguments, error):
    """Templates read a call's arguments as an object (GLM's iterates over them): the JSON text
    OpenAI sends is parsed, and refused when it is not an object."""
    server, client = glm
    call = {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": arguments}}
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]}]  # fmt: skip
    with pytest.raises(openai.BadRequestError, match=rf"messages\[1\]\.tool_calls\[0\].*{error}"):
        client.chat.completions.create(model=server.model, messages=messages, tools=TOOLS)
