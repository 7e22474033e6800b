"""GLM's tool calls and reasoning split (GLM-4.5 … GLM-5): recorded answers in GLM's format,
parsed whole and cut at every point (streamed pieces reassemble to the whole), values typed by
the offered tools' schemas, malformed calls left as text; tool_choice "required" and named
constrained to GLM's own tags."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest

from pegainfer.core.sampling.structured_output import Grammars
from pegainfer.core.text.tokenizer import Tokenizer
from pegainfer.server.chat import AnswerParser
from pegainfer.server.errors import APIError
from pegainfer.server.parsers import registry
from pegainfer.server.reasoning import GlmThinkSplitter
from pegainfer.server.structured import forced_tool_calls
from pegainfer.server.tool_calls import GlmToolCalls, ToolCall, whole_calls
from tests.server.answer_cuts import cuts, feed

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time"}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"},
                                         "filters": {"type": "object"},
                                         "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["query"]}}},
]  # fmt: skip


def call(name: str, *pairs: tuple[str, str], newlines: bool = False) -> str:
    """A call as GLM-4.7 and GLM-5 write it (`newlines`: as GLM-4.5 and 4.6 do)."""
    nl = "\n" if newlines else ""
    args = "".join(f"<arg_key>{k}</arg_key>{nl}<arg_value>{v}</arg_value>{nl}" for k, v in pairs)
    return f"<tool_call>{name}{nl}{args}</tool_call>"


WEATHER = call("get_weather", ("city", "北京"), ("days", "2"))
TIME = call("get_time")
# (answer, content, calls as (name, arguments)), as GLM writes them
TOOL_CASES = [
    (WEATHER, "", [("get_weather", '{"city": "北京", "days": 2}')]),
    ("Let me check.\n" + call("get_weather", ("city", "Paris"), ("days", "3"), newlines=True),
     "Let me check.\n", [("get_weather", '{"city": "Paris", "days": 3}')]),
    # a string parameter stays as written: digits, quotes, newlines, tags of its own
    (call("get_weather", ("city", '12 "<b>x</b>"\n\tend ')), "",
     [("get_weather", '{"city": "12 \\"<b>x</b>\\"\\n\\tend "}')]),
    (TIME, "", [("get_time", "{}")]),
    (WEATHER + "\n" + TIME, "\n", [("get_weather", '{"city": "北京", "days": 2}'),
                                   ("get_time", "{}")]),
    # other values are JSON (objects, arrays, numbers), text that is not JSON a string
    (call("search", ("query", "cats"), ("filters", '{"lang": "en", "n": [1, 2]}'),
          ("tags", '["a", "b"]')), "",
     [("search", '{"query": "cats", "filters": {"lang": "en", "n": [1, 2]}, "tags": ["a", "b"]}')]),
    (call("lookup", ("q", " cats "), ("n", " 5 "), ("ok", "true")), "",
     [("lookup", '{"q": "cats", "n": 5, "ok": true}')]),
    # a name that is not one: the text stays as the model wrote it
    ("<tool_call>not a call</tool_call> after", "<tool_call>not a call</tool_call> after", []),
    ("Plain text, <tool_ and <arg_key>x</arg_key>.", "Plain text, <tool_ and <arg_key>x</arg_key>.",
     []),
    # max_tokens inside a call: one that went out stays cut short, a bare name stays text
    ("Hm." + WEATHER.split("<arg_key>days")[0] + "<arg_key>da", "Hm.",
     [("get_weather", '{"city": "北京"')]),
    ("Hm." + call("get_weather", ("city", "Par")).removesuffix("</arg_value></tool_call>"), "Hm.",
     [("get_weather", '{"city": "Par')]),
    ("<tool_call>get_wea", "<tool_call>get_wea", []),
]  # fmt: skip


def parse(pieces: list[str], tools=TOOLS) -> tuple[str, list[tuple[str, str]], list[ToolCall]]:
    _, content, calls = feed(AnswerParser(None, partial(GlmToolCalls.for_request, tools)), pieces)
    return content, [(c.name, c.arguments) for c in whole_calls(calls)], calls


@pytest.mark.parametrize(("text", "content", "calls"), TOOL_CASES)
def test_calls_whole_and_cut_anywhere(text, content, calls):
    for pieces in cuts(text, step=5):
        assert parse(pieces)[:2] == (content, calls), pieces


def test_token_by_token_matches_whole():
    text = "Sure." + WEATHER + call("search", ("query", "a long query\nin two lines"),
                                    ("filters", '{"x": 1}')) + TIME  # fmt: skip
    assert parse(list(text))[:2] == parse([text])[:2]
    assert [json.loads(a) for _, a in parse([text])[1]] == [
        {"city": "北京", "days": 2},
        {"query": "a long query\nin two lines", "filters": {"x": 1}},
        {},
    ]


def test_values_typed_by_the_request_tools():
    text = call("get_weather", ("city", "123"), ("days", "2"))
    assert parse([text])[1] == [("get_weather", '{"city": "123", "days": 2}')]
    # without the tools' schemas every value is read as JSON where it is JSON
    assert parse([text], tools=[])[1] == [("get_weather", '{"city": 123, "days": 2}')]


def test_arguments_stream_as_they_arrive():
    long_city = "a city whose name is long enough to come in many pieces"
    text = "Sure." + call("get_weather", ("city", long_city), ("days", "4")) + TIME
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    parser = AnswerParser(None, partial(GlmToolCalls.for_request, TOOLS))
    seen = [parser.feed(p, last=n == len(pieces) - 1)[2] for n, p in enumerate(pieces)]
    first = next(n for n, calls in enumerate(seen) if calls)
    assert (seen[first][0].name, seen[first][0].arguments, seen[first][0].index) == (
        "get_weather", "", 0)  # fmt: skip
    assert seen[first][0].id.startswith("call_")
    arguments = [c for calls in seen for c in calls if c.id is None and c.index == 0]
    assert len(arguments) > 5  # the string value in pieces, out before its closing tag
    closed = text.index("</arg_value>") // 4
    assert sum(1 for calls in seen[:closed] for c in calls if c.id is None) > 3
    assert "".join(c.arguments for c in arguments) == json.dumps({"city": long_city, "days": 4},
                                                                 ensure_ascii=False)  # fmt: skip
    assert [c.index for calls in seen for c in calls if c.id is not None] == [0, 1]


THINKING_CASES = [
    # (answer, chat_template_kwargs, reasoning, content, calls' names)
    ("The user wants weather.</think>It is sunny.", {}, "The user wants weather.",
     "It is sunny.", []),
    ("<think>plan</think>" + WEATHER, {}, "plan", "", ["get_weather"]),
    ("\n<think>GLM-4.5 opens it itself.</think>\nAnswer.", {}, "GLM-4.5 opens it itself.",
     "Answer.", []),
    ("Need a tool." + WEATHER, {}, "Need a tool.", "", ["get_weather"]),
    (WEATHER, {}, "", "", ["get_weather"]),  # a forced call
    ("Cut short while thinking", {}, "Cut short while thinking", "", []),
    ("Just an answer.", {"enable_thinking": False}, "", "Just an answer.", []),
    ("Look: " + TIME, {"enable_thinking": False}, "", "Look: ", ["get_time"]),
]  # fmt: skip


@pytest.mark.parametrize(("text", "kwargs", "reasoning", "content", "names"), THINKING_CASES)
def test_reasoning_split_cut_anywhere(text, kwargs, reasoning, content, names):
    for pieces in cuts(text, step=7):
        parser = AnswerParser(lambda: GlmThinkSplitter.for_request(kwargs),
                              partial(GlmToolCalls.for_request, TOOLS))  # fmt: skip
        got_reasoning, got_content, calls = feed(parser, pieces)
        assert (got_reasoning, got_content, [c.name for c in whole_calls(calls)]) == (
            reasoning, content, names), pieces  # fmt: skip


def test_registered_under_vllms_names():
    parsers = registry()
    assert parsers["reasoning"]["glm45"] is GlmThinkSplitter
    assert parsers["tool_call"]["glm45"] is parsers["tool_call"]["glm47"] is GlmToolCalls


@pytest.fixture(scope="module")
def glm_tokenizer(tmp_path_factory) -> Tokenizer:
    pytest.importorskip("pegainfer.models.glm5")
    from pegainfer.models.glm5.tiny import write_tiny_glm5

    out: Path = tmp_path_factory.mktemp("glm-tokenizer")
    write_tiny_glm5(out, weights=False)
    return Tokenizer.from_dir(out)


def accepts(tokenizer: Tokenizer, output, text: str) -> bool:
    """Whether the grammar takes `text` and then the end of the answer."""
    eos = tokenizer.eos_token_id
    matcher = Grammars(lambda: tokenizer, tokenizer.vocab_size).matcher(output, [eos])
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.consume_token(eos)


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "good", "bad"),
    [
        ("required", True,
         [WEATHER + TIME, call("get_weather", ("city", "Rome")),
          call("search", ("query", "x"), ("tags", '["a"]')),
          call("search", ("query", "multi\nline <b>"), ("filters", '{"a":1}'), ("tags", "[]"))],
         ["", "Sure." + WEATHER, call("get_date"), call("get_weather", ("days", "2")),
          call("get_weather", ("days", "2"), ("city", "Rome")),  # required ones first
          call("get_weather", ("city", "Rome"), ("days", "two")),
          call("get_weather", ("city", "Rome"), ("unit", "C")),
          call("search", ("query", "x"), ("filters", '{"a": 1}')),  # compact JSON only
          WEATHER + "</tool_call>"]),
        ("required", False, [TIME], [TIME + TIME]),
        ({"type": "function", "function": {"name": "get_time"}}, True,
         [TIME, call("get_time", ("zone", "UTC+8"))], [WEATHER, TIME + TIME]),
    ],
)  # fmt: skip
def test_forced_calls_are_written_in_glms_format(glm_tokenizer, tool_choice, parallel, good, bad):
    output, make_parser = forced_tool_calls(TOOLS, tool_choice, parallel, GlmToolCalls)
    assert output.kind == "grammar"
    for text in good:
        assert accepts(glm_tokenizer, output, text), text
        parser = make_parser()
        content, calls = parser.feed(text)
        more_content, more_calls = parser.finish()
        calls = whole_calls(calls + more_calls)
        assert content + more_content == "" and calls, text
        assert all(isinstance(json.loads(c.arguments), dict) for c in calls)
    for text in bad:
        assert not accepts(glm_tokenizer, output, text), text


def test_forced_string_values_held_to_enum_and_length(glm_tokenizer):
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {
            "color": {"type": "string", "enum": ["red", "dark blue"]},
            "code": {"type": "string", "minLength": 2, "maxLength": 3}},
        "required": ["color", "code"]}}}]  # fmt: skip
    output, _ = forced_tool_calls(tools, "required", False, GlmToolCalls)
    assert accepts(glm_tokenizer, output, call("pick", ("color", "dark blue"), ("code", "ab")))
    assert accepts(glm_tokenizer, output, call("pick", ("color", "red"), ("code", "a\nb")))
    for color, code in [("green", "ab"), ("red", "a"), ("red", "abcd"), ('"red"', "ab")]:
        assert not accepts(glm_tokenizer, output, call("pick", ("color", color), ("code", code)))


def test_forced_string_keywords_glm_cannot_write_are_refused():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"d": {"type": "string", "format": "date"}}}}}]  # fmt: skip
    with pytest.raises(APIError, match="format") as refused:
        forced_tool_calls(tools, "required", True, GlmToolCalls)
    assert refused.value.status == 400
