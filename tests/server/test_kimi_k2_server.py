"""Kimi-K2's chat format end to end through the server: the scripted line answers in Kimi's
tokens (thinking, a tool-call section), with the tiny Kimi tokenizer, under the kimi_k2
parsers; the openai SDK gets reasoning, tool_calls with Kimi's ids, a round trip through the
chat template, and tool_choice constrained to Kimi's format, streamed and not."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.conftest import start_server, stop_server
from tests.server.helpers import install_scripted_line
from tests.server.test_scripted_line import ask

pytestmark = pytest.mark.line("kimi_k2")

BEGIN, END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL = ('<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
        '{"city":"Beijing"}<|tool_call_end|>')  # fmt: skip
SCRIPTS = [
    ["## Return of", "<think>Got it.</think>It is sunny in Beijing."],
    ["Forced", BEGIN + CALL + END],
    ["Weather", "<think>I need the weather tool.</think>" + BEGIN + CALL + END],
    ["", "Hello there."],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}}]  # fmt: skip


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    from pegainfer.models.kimi_k2.tiny_tokenizer import write_tiny_kimi_tokenizer
    from pegainfer.models.kimi_k2.tokenizer import load_kimi_tokenizer

    root = tmp_path_factory.mktemp("kimi-scripted")
    env = install_scripted_line(root / "plugin")
    model = root / "model"
    vocab_size = write_tiny_kimi_tokenizer(model)
    tokenizer = load_kimi_tokenizer(model)
    # The scripted line reads tokenizer.json (core's loader): the converted Kimi tokenizer.
    (model / "tokenizer.json").write_text(tokenizer.to_json())
    eos = tokenizer.token_to_id("<|im_end|>")
    config = {"model_type": "scripted", "vocab_size": vocab_size, "eos_token_id": eos,
              "scripts": SCRIPTS}  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    server = start_server(model, root / "server.log", "--max-model-len", "2048",
                          "--reasoning-parser", "kimi_k2", "--tool-call-parser", "kimi_k2",
                          env=env)  # fmt: skip
    yield server, openai.OpenAI(base_url=server.base_url, api_key="none")
    stop_server(server)


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_round_trip(kimi, stream):
    server, client = kimi
    messages = [{"role": "user", "content": "Weather in Beijing?"}]
    content, reasoning, calls, reason = ask(client, server, messages, stream, tools=TOOLS)
    assert (content, reasoning, reason) == (None, "I need the weather tool.", "tool_calls")
    assert calls == [("get_weather", {"city": "Beijing"}, "functions.get_weather:0")]
    messages += [
        {"role": "assistant", "content": None, "reasoning_content": reasoning, "tool_calls": [
            {"id": calls[0][2], "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Beijing"}'}}]},
        {"role": "tool", "tool_call_id": calls[0][2], "content": "sunny, 21C"},
    ]  # fmt: skip
    content, reasoning, calls, reason = ask(client, server, messages, stream, tools=TOOLS)
    assert (content, reasoning, calls, reason) == ("It is sunny in Beijing.", "Got it.", [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_off_leaves_the_answer_as_content(kimi, stream):
    server, client = kimi
    messages = [{"role": "user", "content": "Hi"}]
    off = {"chat_template_kwargs": {"thinking": False}}
    assert ask(client, server, messages, stream, extra_body=off)[:2] == ("Hello there.", None)
    # on by default: an answer that never closes its thinking is all reasoning
    content, reasoning, _, _ = ask(client, server, messages, stream)
    assert (content or None, reasoning) == (None, "Hello there.")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_calls_in_kimis_format(kimi, stream, tool_choice):
    server, client = kimi
    messages = [{"role": "user", "content": "Forced weather"}]
    content, _, calls, reason = ask(client, server, messages, stream, tools=TOOLS,
                                    tool_choice=tool_choice)  # fmt: skip
    assert (content, reason) == (None, "tool_calls")
    assert calls == [("get_weather", {"city": "Beijing"}, "functions.get_weather:0")]
