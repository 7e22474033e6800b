"""Chat answer parsers: registered through plugin hooks, chosen by flag or by the model line."""

from __future__ import annotations

import openai
import pytest

from pegainfer.core.errors import ConfigError, ModelLineError
from pegainfer.core.plugins import create_plugin_manager, hookimpl
from pegainfer.server import cli, parsers
from pegainfer.server.reasoning import GlmThinkSplitter, KimiK2ThinkSplitter, ThinkSplitter
from pegainfer.server.tool_calls import (
    GlmToolCalls,
    HermesToolCalls,
    KimiK2ToolCalls,
    Qwen3XmlToolCalls,
)
from tests.server.conftest import start_server, stop_server


class Shouting(ThinkSplitter):
    start_tag, end_tag = "<THINK>", "</THINK>"


class ShoutingPlugin:
    @hookimpl
    def pegainfer_reasoning_parsers(self):
        return {"shouting": Shouting}


def test_a_plugin_adds_a_parser_beside_the_builtins():
    pm = create_plugin_manager(load_entry_points=False)
    pm.register(ShoutingPlugin())
    found = parsers.registry(pm)
    assert found["reasoning"] == {
        "qwen3": ThinkSplitter, "kimi_k2": KimiK2ThinkSplitter, "glm45": GlmThinkSplitter,
        "shouting": Shouting,
    }  # fmt: skip
    assert found["tool_call"] == {
        "hermes": HermesToolCalls, "qwen3_xml": Qwen3XmlToolCalls, "kimi_k2": KimiK2ToolCalls,
        "glm45": GlmToolCalls, "glm47": GlmToolCalls,
    }  # fmt: skip


def test_a_name_registered_twice_is_an_error():
    class Clash:
        @hookimpl
        def pegainfer_tool_call_parsers(self):
            return {"hermes": HermesToolCalls}

    pm = create_plugin_manager(load_entry_points=False)
    pm.register(Clash())
    with pytest.raises(ModelLineError, match="hermes"):
        parsers.registry(pm)


def test_flags_override_the_line_defaults():
    found = parsers.registry(create_plugin_manager(load_entry_points=False))
    line = {"reasoning": "qwen3", "tool_call": "qwen3_xml"}
    chosen = parsers.resolve(found, {"reasoning": None, "tool_call": None}, line)
    assert chosen == {"reasoning": ThinkSplitter, "tool_call": Qwen3XmlToolCalls}
    chosen = parsers.resolve(found, {"reasoning": "none", "tool_call": "hermes"}, line)
    assert chosen == {"reasoning": None, "tool_call": HermesToolCalls}
    assert parsers.resolve(found, {}, {}) == {"reasoning": None, "tool_call": None}
    with pytest.raises(ConfigError, match="unknown tool_call parser 'nope'; known: glm45, "):
        parsers.resolve(found, {"tool_call": "nope"}, line)


def test_an_unknown_parser_flag_stops_the_server_at_once(tiny_model, capsys):
    assert cli.main(["--model-path", str(tiny_model), "--tool-call-parser", "nope"]) == 2
    assert "unknown tool_call parser 'nope'" in capsys.readouterr().err


def test_the_line_default_serves_tools_and_none_refuses_them(server, tiny_model, tmp_path):
    """The shared server was started without parser flags: Qwen3's hermes parser serves
    tools. With --tool-call-parser none, tools get a 400."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    messages = [{"role": "user", "content": "hi"}]
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    client.chat.completions.create(model=server.model, messages=messages, tools=tools,
                                   max_tokens=2)  # fmt: skip
    running = start_server(tiny_model, tmp_path / "log", "--tool-call-parser", "none")
    try:
        client = openai.OpenAI(base_url=running.base_url, api_key="none")
        with pytest.raises(openai.BadRequestError, match="tools need one"):
            client.chat.completions.create(model=running.model, messages=messages, tools=tools,
                                           max_tokens=2)  # fmt: skip
    finally:
        stop_server(running)
