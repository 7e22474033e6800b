"""Tool calls: hermes-style `<tool_call>{json}</tool_call>` parsed whole and as it streams,
rendered back through the chat template, and the server's tool handling end to end."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import openai
import pytest

from pegainfer.server.chat import AnswerParser
from pegainfer.server.reasoning import ThinkSplitter
from pegainfer.server.structured import forced_tool_calls
from pegainfer.server.tool_calls import TOOL_CALL_PARSERS, HermesToolCalls, whole_calls
from tests.server.conftest import start_server, stop_server

CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
CASES = [
    (CALL, "", [("weather", {"city": "Paris", "days": 2})]),
    ("Let me check." + CALL + CALL, "Let me check.",
     [("weather", {"city": "Paris", "days": 2})] * 2),
    ("No call here.", "No call here.", []),
    ("<tool_call>not json</tool_call> done", "<tool_call>not json</tool_call> done", []),
    ("<tool_call>{\"name\": \"cut", "<tool_call>{\"name\": \"cut", []),
    ("<tool_c", "<tool_c", []),
]  # fmt: skip


def parse(pieces: list[str], kind: str = "hermes") -> tuple[str, list[tuple[str, dict]]]:
    parser, content, calls = AnswerParser(None, TOOL_CALL_PARSERS[kind]), "", []
    for n, piece in enumerate(pieces):
        _, text, new = parser.feed(piece, last=n == len(pieces) - 1)
        content += text
        calls += new
    return content, [(c.name, json.loads(c.arguments)) for c in whole_calls(calls)]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_every_way_of_cutting_the_stream_in_three(text, content, calls):
    assert parse([text]) == (content, calls)
    for i, j in itertools.combinations_with_replacement(range(0, len(text) + 1, 3), 2):
        assert parse([text[:i], text[i:j], text[j:]]) == (content, calls), (i, j)


XML_CALL = ("<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n<parameter=units>\n[\"C\"]\n</parameter>\n"
            "</function>\n</tool_call>")  # fmt: skip
XML_CASES = [
    (XML_CALL, "", [("weather", {"city": "Paris", "days": 2, "units": ["C"]})]),
    ("First: " + XML_CALL + " then text", "First:  then text",
     [("weather", {"city": "Paris", "days": 2, "units": ["C"]})]),
    ("<tool_call>\n{\"name\": \"json\"}\n</tool_call>",
     "<tool_call>\n{\"name\": \"json\"}\n</tool_call>", []),
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "calls"), XML_CASES)
def test_qwen35_xml_calls_in_every_cut(text, content, calls):
    assert parse([text], "qwen3_xml") == (content, calls)
    for i, j in itertools.combinations_with_replacement(range(0, len(text) + 1, 5), 2):
        assert parse([text[:i], text[i:j], text[j:]], "qwen3_xml") == (content, calls), (i, j)


def test_reasoning_then_a_call():
    parser = AnswerParser(ThinkSplitter, TOOL_CALL_PARSERS["hermes"])
    reasoning, content, calls = parser.feed("<think>\nNeed weather.\n</think>\n\n" + CALL, True)
    assert reasoning == "\nNeed weather.\n" and content == "" and calls[0].name == "weather"
    assert calls[0].id.startswith("call_")


@pytest.fixture(scope="module")
def tool_server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("tools-log") / "server.log"
    running = start_server(tiny_model, log, "--max-model-len", "1024",
                           "--tool-call-parser", "hermes")  # fmt: skip
    yield running
    stop_server(running)


TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "Weather by city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


def test_a_tool_round_trip_is_rendered_and_answered(tool_server):
    """Tools, an assistant turn with tool_calls and the tool's answer all go through the chat
    template (Qwen3's), and the server answers, streamed and not."""
    client = openai.OpenAI(base_url=tool_server.base_url, api_key="none")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    prompt_tokens = {}
    for tools in (TOOLS, None):
        create = client.chat.completions.create
        reply = create(model=tool_server.model, messages=messages, tools=tools, max_tokens=8,
                       temperature=0)  # fmt: skip
        assert reply.choices[0].finish_reason in {"stop", "length", "tool_calls"}
        prompt_tokens[tools is None] = reply.usage.prompt_tokens
    assert prompt_tokens[False] > prompt_tokens[True] + 20  # the tools are in the prompt
    chunks = client.chat.completions.create(model=tool_server.model, messages=messages,
                                            tools=TOOLS, max_tokens=8, temperature=0,
                                            stream=True)  # fmt: skip
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] in {"stop", "length", "tool_calls"}


# Bounded arguments, so that a random model's constrained answer ends within max_tokens.
BOUNDED = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                     "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"], "additionalProperties": False}}}
    for name in ("weather", "tides")]  # fmt: skip


def check_arguments(arguments: str) -> None:
    parsed = json.loads(arguments)
    assert set(parsed) == {"city", "days"} and parsed["days"] in (1, 2, 3)
    assert isinstance(parsed["city"], str) and len(parsed["city"]) <= 6


@dataclass
class StreamedCall:
    id: str
    name: str
    arguments: str
    pieces: int  # argument pieces after the first (the one naming the call)


def streamed_calls(deltas) -> list[StreamedCall]:
    """The calls a stream's tool_call deltas make, joined by index as clients join them: the
    first piece of a call carries its id and name (once), the others more of its arguments."""
    calls: dict[int, StreamedCall] = {}
    for delta in deltas:
        indexes = [piece.index for piece in delta.tool_calls or []]
        assert len(indexes) == len(set(indexes)), delta  # one entry per call in a chunk
        for piece in delta.tool_calls or []:
            if piece.index not in calls:
                assert piece.id and piece.function.name, piece
                calls[piece.index] = StreamedCall(piece.id, piece.function.name,
                                                  piece.function.arguments or "", 0)  # fmt: skip
                continue
            assert piece.id is None and piece.function.name is None, piece
            calls[piece.index].arguments += piece.function.arguments
            calls[piece.index].pieces += 1
    return list(calls.values())


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "tides"])
def test_forced_tool_choice_is_decoded_into_calls(tool_server, choice, stream):
    """tool_choice "required" and a named function constrain the random model's answer to
    calls of the offered tools, whose arguments match their schema (three seeds each);
    streamed, the arguments go out as they are decoded, not whole at the end."""
    client = openai.OpenAI(base_url=tool_server.base_url, api_key="none")
    tool_choice = choice if choice == "required" else {"type": "function",
                                                       "function": {"name": choice}}  # fmt: skip
    pieces = 0
    for seed in range(3):
        kwargs = dict(model=tool_server.model, tools=BOUNDED, tool_choice=tool_choice,
                      max_tokens=200, seed=seed, temperature=1.0,
                      messages=[{"role": "user", "content": "Weather in Paris?"}])  # fmt: skip
        if stream:
            deltas = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs)
                      if c.choices]  # fmt: skip
            calls = streamed_calls(d.delta for d in deltas)
            pieces += sum(call.pieces for call in calls)
            reason = deltas[-1].finish_reason
            assert "".join(d.delta.content or "" for d in deltas) == ""
        else:
            message = client.chat.completions.create(**kwargs).choices[0]
            reason = message.finish_reason
            calls = [StreamedCall(c.id, c.function.name, c.function.arguments, 0)
                     for c in message.message.tool_calls or []]  # fmt: skip
            assert message.message.content is None
        assert reason == "tool_calls" and calls
        for call in calls:
            assert call.name == choice or choice == "required"
            assert call.name in {"weather", "tides"} and call.id.startswith("call_")
            check_arguments(call.arguments)
    # Each call's arguments are a dozen tokens or more: they came in more pieces than calls
    # (a consumer behind the engine may get several tokens at once, never all of them).
    assert not stream or pieces > 3


TAG_TOOL = {"type": "function", "function": {"name": "tag", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["open", "close"],
    "properties": {"open": {"enum": ["<tool_call>", "<think>"]},
                   "close": {"const": "</tool_call>"}}}}}  # fmt: skip


@pytest.mark.parametrize("choice", ["required", "tag"])
def test_forced_arguments_holding_qwens_tags(tool_server, choice):
    """Arguments whose values are the text of Qwen's added tokens (`<tool_call>` ...), which
    the model may write as the one token: the request failed after its first tokens."""
    tool_choice = choice if choice == "required" else {"type": "function",
                                                       "function": {"name": choice}}  # fmt: skip
    client = openai.OpenAI(base_url=tool_server.base_url, api_key="none")
    for seed in range(3):
        reply = client.chat.completions.create(
            model=tool_server.model, tools=[TAG_TOOL], tool_choice=tool_choice, max_tokens=120,
            seed=seed, temperature=1.0, messages=[{"role": "user", "content": "Tag it."}],
        )  # fmt: skip
        assert reply.choices[0].finish_reason == "tool_calls"
        assert reply.choices[0].message.tool_calls
        for call in reply.choices[0].message.tool_calls:
            arguments = json.loads(call.function.arguments)
            assert call.function.name == "tag" and arguments["close"] == "</tool_call>"
            assert arguments["open"] in ("<tool_call>", "<think>")


def _nested_tool(name: str, field: str, model: dict) -> dict:
    """A tool as pydantic writes a nested model: the model in $defs, used through $ref."""
    parameters = {
        "type": "object",
        "properties": {field: {"$ref": "#/$defs/Place"}},
        "required": [field],
        "additionalProperties": False,
        "$defs": {"Place": model},
    }
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# Two tools whose nested models share a name but not a shape.
NESTED = [
    _nested_tool("ship", "to", {"type": "object", "properties": {"city": {"enum": ["Oslo"]}},
                                "required": ["city"], "additionalProperties": False}),
    _nested_tool("moor", "at", {"type": "object", "properties": {"port": {"enum": [1, 2]}},
                                "required": ["port"], "additionalProperties": False}),
]  # fmt: skip


def test_required_tool_choice_keeps_each_tools_definitions(tool_server):
    """$defs and $ref in tool parameters (every nested pydantic model) once gave a 400:
    wrapped into one schema, the pointers no longer resolved."""
    client = openai.OpenAI(base_url=tool_server.base_url, api_key="none")
    allowed = {
        "ship": [{"to": {"city": "Oslo"}}],
        "moor": [{"at": {"port": 1}}, {"at": {"port": 2}}],
    }
    for seed in range(3):
        choice = client.chat.completions.create(
            model=tool_server.model, tools=NESTED, tool_choice="required", max_tokens=200,
            seed=seed, temperature=1.0, messages=[{"role": "user", "content": "Ship it"}],
        ).choices[0]  # fmt: skip
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert json.loads(call.function.arguments) in allowed[call.function.name]


def test_required_tool_choice_rebases_a_recursive_tool():
    """A "#" reference (the tool's own parameters) must point at them, not at the wrapper."""
    tree = {"type": "object", "properties": {"child": {"$ref": "#"}, "n": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "tree", "parameters": tree}}]
    output, _ = forced_tool_calls(tools, "required")
    schema = json.loads(output.spec)
    assert schema["$defs"]["tool0"]["properties"]["child"] == {"$ref": "#/$defs/tool0"}


def test_parallel_tool_calls_false_keeps_only_the_first_parsed_call():
    text = "Let me check." + CALL + CALL.replace("Paris", "Oslo")
    for i, j in itertools.combinations_with_replacement(range(0, len(text) + 1, 7), 2):
        parser, calls = AnswerParser(None, TOOL_CALL_PARSERS["hermes"], max_calls=1), []
        for n, piece in enumerate((text[:i], text[i:j], text[j:])):
            calls += parser.feed(piece, last=n == 2)[2]
        assert [json.loads(c.arguments)["city"] for c in whole_calls(calls)] == ["Paris"], (i, j)


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_makes_required_one_call(tool_server, stream):
    """It was not enforced: two calls in 4 of 6 seeds."""
    client = openai.OpenAI(base_url=tool_server.base_url, api_key="none")
    for seed in range(6):
        kwargs = dict(model=tool_server.model, tools=BOUNDED, tool_choice="required",
                      parallel_tool_calls=False, max_tokens=200, seed=seed, temperature=1.0,
                      messages=[{"role": "user", "content": "Weather in Paris?"}])  # fmt: skip
        if stream:
            chunks = client.chat.completions.create(stream=True, **kwargs)
            arguments = [c.arguments for c in streamed_calls(c.choices[0].delta for c in chunks
                                                              if c.choices)]  # fmt: skip
        else:
            calls = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
            arguments = [c.function.arguments for c in calls]
        assert len(arguments) == 1, (seed, arguments)
        check_arguments(arguments[0])


def test_hermes_arguments_go_out_as_they_arrive():
    """Fed a character at a time: the call's id and name once they are known, then its
    arguments in pieces, all before the closing tag."""
    parser, pieces = HermesToolCalls(), []
    for char in CALL[: -len("</tool_call>")]:
        content, new = parser.feed(char)
        assert content == ""
        pieces += new
    first, *rest = pieces
    assert (first.name, first.arguments) == ("weather", "") and first.id.startswith("call_")
    assert len(rest) > 5 and all(p.id is None and p.index == first.index for p in rest)
    assert json.loads("".join(p.arguments for p in rest)) == {"city": "Paris", "days": 2}
    assert parser.feed("</tool_call>") == ("", [])
