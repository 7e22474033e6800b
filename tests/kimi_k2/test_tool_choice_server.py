"""tool_choice on a served tiny Kimi-K2 checkpoint: its random model, held to a grammar of
Kimi's own tool-call tokens, answers with a call the kimi_k2 parser (the line's default) reads
back; the tokenizer is the line's tiktoken conversion in the server and in the engine."""

from __future__ import annotations

import json
import re

import openai
import pytest

from pegainfer.core.tiny import main as tiny_main
from tests.server.conftest import start_server, stop_server
from tests.server.test_scripted_line import ask

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Beijing", "Paris"]}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
]  # fmt: skip


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-kimi-tools")
    assert tiny_main(["kimi-k2", str(root / "model")]) == 0
    server = start_server(root / "model", root / "server.log", "--max-model-len", "512")
    yield server, openai.OpenAI(base_url=server.base_url, api_key="none")
    stop_server(server)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("tool_choice", "names"),
    [({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
     ("required", {"get_weather", "get_time"})],
)  # fmt: skip
def test_forced_calls_come_back_as_tool_calls(kimi, stream, tool_choice, names):
    server, client = kimi
    messages = [{"role": "user", "content": "What is the weather in Beijing?"}]
    content, _, calls, reason = ask(client, server, messages, stream, tools=TOOLS,
                                    tool_choice=tool_choice, parallel_tool_calls=False,
                                    temperature=0)  # fmt: skip
    assert (content, reason) == (None, "tool_calls")
    [(name, arguments, call_id)] = calls
    assert name in names and re.fullmatch(rf"functions\.{name}:\d{{1,4}}", call_id)
    expected = {"get_weather": {"city": ["Beijing", "Paris"]}, "get_time": {}}[name]
    assert arguments.keys() == expected.keys()
    assert all(arguments[k] in v for k, v in expected.items()), json.dumps(arguments)
