"""vLLM's tests/entrypoints/openai/chat_completion/test_include_reasoning.py, and the thinking and
`auto` halves of test_completion_with_function_calling.py::test_function_tool_use, on the
scripted test line (tests/server/scripted_line.py: answers written out per prompt marker, Qwen3's
tokenizer and template, so the line's qwen3 reasoning and hermes tool-call parsers read them)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from pegainfer.models.qwen3.tiny import write_tiny_qwen3
from tests.server.conftest import start_server, stop_server
from tests.server.helpers import install_scripted_line

REASONING = "one and one make two"
ANSWER = "2"
CALL = '<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Berlin"}}\n</tool_call>'
SCRIPTS = [
    ["What is 1+1?", f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"],
    ["Weather in Berlin", f"<think>\nI need the weather tool.\n</think>\n\n{CALL}"],
    ["", "No script for this prompt."],
]
MESSAGES = [{"role": "user", "content": "What is 1+1? Be concise."}]
TOOLS = [{"type": "function", "function": {"name": "get_current_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def scripted(tmp_path_factory) -> Iterator[tuple[str, openai.OpenAI]]:
    root = tmp_path_factory.mktemp("vllm-contract-scripted")
    env = install_scripted_line(root / "plugin")
    model = root / "model"
    write_tiny_qwen3(model)  # its tokenizer, chat template and generation config
    config = json.loads((model / "config.json").read_text())
    scripted_config = {"model_type": "scripted", "vocab_size": config["vocab_size"],
                       "eos_token_id": config["eos_token_id"], "scripts": SCRIPTS}  # fmt: skip
    (model / "config.json").write_text(json.dumps(scripted_config))
    server = start_server(model, root / "server.log", "--max-model-len", "2048", env=env)
    yield server.model, openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    stop_server(server)


def answer(scripted, stream: bool, **kwargs) -> tuple[str, str, object]:
    """(reasoning, content, usage) of one answer, streamed or not; reasoning under either of
    vLLM's names."""
    model, client = scripted
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=100, temperature=0, **kwargs)
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        message = reply.choices[0].message
        reasoning = message.model_extra.get("reasoning") or message.model_extra.get(
            "reasoning_content"
        )
        return reasoning or "", message.content or "", reply.usage
    reasoning, content, usage = "", "", None
    for chunk in client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    ):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            reasoning += extra.get("reasoning") or extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
    return reasoning, content, usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("include", [True, False, None], ids=["true", "false", "default"])
def test_include_reasoning(scripted, stream, include):
    """test_include_reasoning_true_non_streaming, _false_non_streaming, _true_streaming,
    _false_streaming, test_default_includes_reasoning, test_reasoning_tokens_in_usage: the
    thinking comes apart from the content unless include_reasoning is false; the content
    comes either way, and the thinking's tokens are counted in usage either way."""
    extra = {} if include is None else {"include_reasoning": include}
    reasoning, content, usage = answer(scripted, stream, extra_body=extra)
    assert content.strip() == ANSWER
    assert reasoning.strip() == ("" if include is False else REASONING)
    assert usage.completion_tokens_details.reasoning_tokens > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_function_tool_use_auto_with_thinking(scripted, stream):
    """test_function_tool_use[auto, enable_thinking=True]: the reasoning and the call come
    apart, the call's arguments whole JSON, finish_reason tool_calls."""
    model, client = scripted
    kwargs = dict(model=model, tools=TOOLS, tool_choice="auto", max_tokens=100,
                  messages=[{"role": "user", "content": "Weather in Berlin, now?"}],
                  extra_body={"chat_template_kwargs": {"enable_thinking": True}})  # fmt: skip
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.message.model_extra["reasoning"]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        reason = choice.finish_reason
    else:
        reasoning, pieces, reason, name = "", "", None, None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning") or ""
            for call in delta.tool_calls or []:
                name = call.function.name or name
                pieces += call.function.arguments or ""
            reason = chunk.choices[0].finish_reason or reason
        assert reasoning
        calls = [(name, pieces)]
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [
        ("get_current_weather", {"city": "Berlin"})
    ]
    assert reason == "tool_calls"
