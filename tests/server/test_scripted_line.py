"""The chat features end to end with the openai SDK, on a test-only line that writes scripted
answers (`scripted_line.py`, installed through an entry point as a third party would): a full
tool-call round trip, the reasoning split, and n = 3 seeded choices, streamed and not."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pegainfer.models.qwen3.tiny import write_tiny_qwen3
from tests.server.conftest import start_server, stop_server
from tests.server.helpers import install_scripted_line, sse_payloads

CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
XML_CALL = ("<tool_call>\n<function=weather>\n<parameter=city>\nSão Paulo, 2024\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")  # fmt: skip
SCRIPTS = [
    ["<tool_response>", "It is sunny in Paris."],
    ["Plan my day", "<think>\nThe user wants a plan.\n</think>\n\nWake up, then work."],
    ["Pick numbers", "Yours: §§§§§§§§."],
    ["Weather, one token at a time?", CALL, 0.05],
    ["Weather as XML, one token at a time?", XML_CALL, 0.05],
    ["", CALL],
]
TOOLS = [{"type": "function", "function": {
    "name": "weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def scripted_model(tmp_path_factory):
    """The scripted line's checkpoint and the environment that installs it."""
    root = tmp_path_factory.mktemp("scripted")
    env = install_scripted_line(root / "plugin")
    model = root / "model"
    write_tiny_qwen3(model)  # its tokenizer, chat template and generation config
    config = json.loads((model / "config.json").read_text())
    scripted_config = {"model_type": "scripted", "vocab_size": config["vocab_size"],
                       "eos_token_id": config["eos_token_id"], "scripts": SCRIPTS}  # fmt: skip
    (model / "config.json").write_text(json.dumps(scripted_config))
    return model, env


@pytest.fixture(scope="module")
def scripted(scripted_model):
    model, env = scripted_model
    server = start_server(model, model.parent / "server.log", "--max-model-len", "2048", env=env)
    yield server, openai.OpenAI(base_url=server.base_url, api_key="none")
    stop_server(server)


def ask(client, server, messages, stream=False, **kwargs):
    """The answer's (content, reasoning, tool calls as (name, arguments), finish reasons)."""
    kwargs = dict(model=server.model, messages=messages, max_tokens=100, **kwargs)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        message = choice.message
        calls = [(c.function.name, json.loads(c.function.arguments), c.id)
                 for c in message.tool_calls or []]  # fmt: skip
        return (
            message.content,
            getattr(message, "reasoning_content", None),
            calls,
            choice.finish_reason,
        )
    content, reasoning, reason = "", "", None
    streamed: dict[int, list] = {}  # a call's index -> [name, arguments so far, id]
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for c in delta.tool_calls or []:  # a call's first piece names it; more of it follow
            call = streamed.setdefault(c.index, [c.function.name, "", c.id])
            call[1] += c.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    calls = [(name, json.loads(arguments), id_) for name, arguments, id_ in streamed.values()]
    return content or None, reasoning or None, calls, reason


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_round_trip(scripted, stream):
    server, client = scripted
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    content, _, calls, reason = ask(client, server, messages, stream, tools=TOOLS)
    assert (content, reason) == (None, "tool_calls")
    assert [(name, args) for name, args, _ in calls] == [("weather", {"city": "Paris"})]
    call_id = calls[0][2]
    assert call_id.startswith("call_")
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21C"},
    ]  # fmt: skip
    content, _, calls, reason = ask(client, server, messages, stream, tools=TOOLS)
    assert (content, calls, reason) == ("It is sunny in Paris.", [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_split_from_the_answer(scripted, stream):
    server, client = scripted
    messages = [{"role": "user", "content": "Plan my day"}]
    content, reasoning, calls, reason = ask(client, server, messages, stream)
    assert reasoning.strip() == "The user wants a plan."
    assert content.strip() == "Wake up, then work." and not calls and reason == "stop"


def test_three_seeded_choices_differ_and_repeat(scripted):
    server, client = scripted
    kwargs = dict(model=server.model, messages=[{"role": "user", "content": "Pick numbers"}],
                  n=3, seed=11, temperature=1.0, max_tokens=30)  # fmt: skip
    first = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
    again = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
    assert first == again and len(set(first)) == 3
    assert all(text.startswith("Yours: ") and text[7:15].isdigit() for text in first)


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_comes_under_both_names_and_is_counted(scripted, stream):
    """vLLM's current `reasoning` beside `reasoning_content`, and usage's reasoning_tokens."""
    server, _ = scripted
    body = {"model": server.model, "messages": [{"role": "user", "content": "Plan my day"}],
            "max_tokens": 100, "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    response = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    if stream:
        chunks = sse_payloads(response.content)
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        reasoning = "".join(d.get("reasoning") or "" for d in deltas)
        assert reasoning == "".join(d.get("reasoning_content") or "" for d in deltas)
        usage = chunks[-1]["usage"]
    else:
        payload = response.json()
        message = payload["choices"][0]["message"]
        reasoning = message["reasoning"]
        assert reasoning == message["reasoning_content"]
        usage = payload["usage"]
    assert reasoning.strip() == "The user wants a plan."
    counted = httpx.post(server.url + "/tokenize", json={"prompt": reasoning}, timeout=30)
    reasoning_tokens = usage["completion_tokens_details"]["reasoning_tokens"]
    assert reasoning_tokens == counted.json()["count"] < usage["completion_tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_include_reasoning_false_leaves_the_thinking_out(scripted, stream):
    server, client = scripted
    messages = [{"role": "user", "content": "Plan my day"}]
    content, reasoning, _, _ = ask(client, server, messages, stream,
                                   extra_body={"include_reasoning": False})  # fmt: skip
    assert reasoning is None and content.strip() == "Wake up, then work."


def test_a_hermes_call_streams_its_arguments_as_they_arrive(scripted):
    """They came in one piece after the closing tag; now as vLLM's parsers send them: the
    call's id and name first, then its arguments in pieces."""
    server, _ = scripted
    # The script pauses at each token: a busy test machine must not merge the pieces.
    question = "Weather, one token at a time?"
    body = {"model": server.model, "messages": [{"role": "user", "content": question}],
            "tools": TOOLS, "max_tokens": 100, "stream": True}  # fmt: skip
    raw = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60).content
    pieces = [call for c in sse_payloads(raw) if c["choices"]
              for call in c["choices"][0]["delta"].get("tool_calls") or []]  # fmt: skip
    first, *rest = pieces
    assert first["id"].startswith("call_") and first["function"]["name"] == "weather"
    assert len(rest) > 1 and all(set(p) == {"index", "function"} for p in rest)
    arguments = first["function"]["arguments"] + "".join(p["function"]["arguments"] for p in rest)
    assert json.loads(arguments) == {"city": "Paris"}


def test_an_xml_call_streams_its_arguments_typed_by_the_tools_schema(scripted_model):
    """Qwen3.5's XML calls (qwen3_xml) stream too: the string value as it arrives, the
    integer once whole; the values typed by the request's tools (the city stays a string,
    though it holds a number), streamed and not alike."""
    model, env = scripted_model
    server = start_server(model, model.parent / "xml-server.log", "--max-model-len", "2048",
                          "--tool-call-parser", "qwen3_xml", env=env)  # fmt: skip
    try:
        question = [{"role": "user", "content": "Weather as XML, one token at a time?"}]
        body = {"model": server.model, "tools": TOOLS, "max_tokens": 100, "messages": question}
        raw = httpx.post(server.base_url + "/chat/completions", json=body | {"stream": True},
                         timeout=60).content  # fmt: skip
        whole = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60).json()
    finally:
        stop_server(server)
    chunks = [c["choices"][0] for c in sse_payloads(raw) if c["choices"]]
    first, *rest = [call for c in chunks for call in c["delta"].get("tool_calls") or []]
    assert first["id"].startswith("call_") and first["function"]["name"] == "weather"
    assert len(rest) > 3 and all(set(p) == {"index", "function"} for p in rest)
    arguments = first["function"]["arguments"] + "".join(p["function"]["arguments"] for p in rest)
    assert json.loads(arguments) == {"city": "São Paulo, 2024", "days": 3}
    assert chunks[-1]["finish_reason"] == "tool_calls"
    (call,) = whole["choices"][0]["message"]["tool_calls"]
    assert call["function"]["arguments"] == arguments
