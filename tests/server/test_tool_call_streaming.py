"""Tool-call arguments stream as they arrive (issue 28, item 10) for Qwen3.5's XML calls and
for the JSON of forced calls (tool_choice "required" or a named function), as vLLM's parsers
send them: a call's id and name first, once, then pieces of its arguments' JSON whose
concatenation is exactly the arguments of the answer parsed whole.

Recorded answers are cut at every character, fed a character at a time and fed a token at a
time through the tiny Qwen3 tokenizer's incremental detokenizer (the deltas a server streams);
every way gives the whole-text parse's content and calls."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from functools import partial

import pytest

from pegainfer.core.text.detokenizer import IncrementalDetokenizer
from pegainfer.core.text.tokenizer import Tokenizer
from pegainfer.models.qwen3.tiny import write_tiny_qwen3
from pegainfer.server.chat import AnswerParser
from pegainfer.server.tool_calls import (
    ForcedToolCalls,
    Qwen3XmlToolCalls,
    ToolCall,
    ToolCallParser,
    joined,
    whole_calls,
)


def _tool(name: str, properties: dict, **extra) -> dict:
    parameters = {"type": "object", "properties": properties, **extra}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOLS = [
    _tool("weather", {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "units": {"type": "array", "items": {"type": "string"}},
        "when": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    }),
    _tool("write_file", {"path": {"type": "string"}, "content": {"type": "string"},
                         "mode": {"enum": ["w", "a"]}, "options": {"$ref": "#/$defs/Options"}},
          **{"$defs": {"Options": {"type": "object"}}}),
    _tool("now", {}),
]  # fmt: skip


def xml_call(name: str, *parameters: tuple[str, str]) -> str:
    """A call as Qwen3.5 and Qwen3-Coder write it."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


CODE = 'def f(x):\n    return "<b>" + x  # a \\ backslash, a tab\t and a \u00e9\n'
# (answer, content, calls as (name, arguments)), as the tools' schemas type the values.
XML_ANSWERS = [
    ("I'll check.\n\n" + xml_call("weather", ("city", "São Paulo"), ("days", "3"),
                                  ("metric", "True"), ("units", '["C", "mm"]'), ("when", "null")),
     "I'll check.\n\n",
     [("weather", {"city": "São Paulo", "days": 3, "metric": True, "units": ["C", "mm"],
                   "when": None})]),
    # Code in a string (its own last newline kept, the layout's dropped), a value that would
    # read as a number but is a string, an enum of strings, an object through $ref; two calls.
    (xml_call("write_file", ("path", "/tmp/a.py"), ("content", CODE + "\n"), ("mode", "w"),
              ("options", '{"force": true}'))
     + "\n" + xml_call("weather", ("city", "2024"), ("days", "three")),
     "\n",
     [("write_file", {"path": "/tmp/a.py", "content": CODE + "\n", "mode": "w",
                      "options": {"force": True}}),
      ("weather", {"city": "2024", "days": "three"})]),
    # A function's end inside a string value is text until the value's closing tag.
    (xml_call("write_file", ("content", "x = '</function>'")) + " done",
     " done", [("write_file", {"content": "x = '</function>'"})]),
    # A function the tools do not name: values read as JSON where they are, else strings.
    (xml_call("lookup", ("id", "42"), ("tags", '{"a": [1, 2]}'), ("note", "plain text"),
              ("ratio", "NaN")),
     "", [("lookup", {"id": 42, "tags": {"a": [1, 2]}, "note": "plain text", "ratio": "NaN"})]),
    (xml_call("now"), "", [("now", {})]),
    # A value whose closing tag never came ends at the function's end.
    ("<tool_call>\n<function=weather>\n<parameter=city>\nOslo\n</function>\n</tool_call>",
     "", [("weather", {"city": "Oslo"})]),
    # Cut short (max_tokens): the call stays cut short, its arguments as far as they went (a
    # value that needs its whole text not begun), as vLLM's parsers leave it.
    ("<tool_call>\n<function=weather>\n<parameter=city>\nPar", "",
     [("weather", '{"city": "Par')]),
    ("<tool_call>\n<function=weather>\n<parameter=days>\n1", "", [("weather", '{"days": ')]),
    # Not calls: the text stays as the model wrote it.
    ("<tool_call>\n<function=wea", "<tool_call>\n<function=wea", []),
    ('<tool_call>\n{"name": "json"}\n</tool_call>', '<tool_call>\n{"name": "json"}\n</tool_call>',
     []),
]  # fmt: skip


def feed(make: Callable[[], ToolCallParser], pieces: list[str]) -> tuple[str, list[ToolCall]]:
    """The content and call pieces of an answer streamed in `pieces`."""
    parser, content, calls = AnswerParser(None, make), "", []
    for n, piece in enumerate(pieces):
        _, text, new = parser.feed(piece, last=n == len(pieces) - 1)
        content += text
        calls += new
    return content, calls


def settled(pieces: list[ToolCall]) -> list[tuple[str | None, str]]:
    """Each call's name and arguments, checking the pieces' shape: the first names the call
    (once, with an id), the rest carry only arguments."""
    seen: set[int | None] = set()
    for piece in pieces:
        if piece.id is None:
            assert piece.name is None and piece.index in seen, piece
        else:
            assert piece.id.startswith("call_") and piece.index not in seen, piece
            seen.add(piece.index)
    return [(call.name, call.arguments) for call in whole_calls(pieces)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tiny-qwen3-tokenizer")
    write_tiny_qwen3(path)
    return Tokenizer.from_dir(path)


def token_deltas(tokenizer: Tokenizer, text: str) -> Iterator[str]:
    """The text deltas a server streams for `text` generated a token at a time."""
    detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        yield detokenizer.push([token_id]).text
    yield detokenizer.flush()


def every_way(tokenizer: Tokenizer, text: str) -> Iterator[tuple[str, list[str]]]:
    yield "whole", [text]
    for cut in range(len(text) + 1):
        yield f"cut at {cut}", [text[:cut], text[cut:]]
    yield "a character at a time", list(text)
    tokens = list(token_deltas(tokenizer, text))
    assert "".join(tokens) == text
    yield "a token at a time", tokens


@pytest.mark.parametrize(("text", "content", "calls"), XML_ANSWERS)
def test_xml_calls_are_the_same_however_the_answer_is_cut(tokenizer, text, content, calls):
    make = partial(Qwen3XmlToolCalls.for_request, TOOLS)
    whole_content, whole_pieces = feed(make, [text])
    whole = settled(whole_pieces)
    assert whole_content == content
    # The arguments are JSON as json.dumps writes it (a call cut short: as far as it went).
    assert whole == [
        (name, arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                       ensure_ascii=False))
        for name, arguments in calls
    ]  # fmt: skip
    for way, pieces in every_way(tokenizer, text):
        got_content, got_pieces = feed(make, pieces)
        assert (got_content, settled(got_pieces)) == (content, whole), way


def test_xml_arguments_go_out_before_the_call_closes():
    """Fed a character at a time, every call goes out in several pieces, and a string value
    streams inside its parameter (a long value need not wait for its closing tag)."""
    text = XML_ANSWERS[1][0]
    parser, sent, pieces = Qwen3XmlToolCalls.for_request(TOOLS), "", []
    closing = text.index("\n</parameter>", text.index("<parameter=content>"))
    for at, char in enumerate(text):
        if at == closing:
            # Held back: the last newline only (the layout's, it turns out).
            assert sent.endswith(json.dumps(CODE, ensure_ascii=False)[1:-1]), sent
        new = parser.feed(char)[1]
        sent += "".join(piece.arguments for piece in new)
        pieces += new
    for index in (0, 1):
        mine = [piece for piece in pieces if piece.index == index]
        assert mine[0].id is not None and len(mine) > 5, mine


def _typed(schema: dict | None, raw: str):
    """The value a one-parameter call with `raw` written for `schema` passes."""
    tool = _tool("f", {} if schema is None else {"x": schema})
    _, pieces = feed(partial(Qwen3XmlToolCalls.for_request, [tool]), [xml_call("f", ("x", raw))])
    return json.loads(whole_calls(pieces)[0].arguments)["x"]


@pytest.mark.parametrize(
    ("schema", "raw", "value"),
    [
        ({"type": "string"}, "123", "123"),
        ({"type": "string"}, "null", "null"),
        ({"type": "string"}, '"quoted"', '"quoted"'),
        ({"type": "integer"}, "3", 3),
        ({"type": "integer"}, "three", "three"),
        ({"type": "number"}, "2", 2),
        ({"type": "number"}, "2.5", 2.5),
        ({"type": "boolean"}, "false", False),
        ({"type": "boolean"}, "True", True),
        ({"type": "array"}, "[1, 2]", [1, 2]),
        ({"type": "object"}, '{"a": {"b": null}}', {"a": {"b": None}}),
        ({"type": ["integer", "null"]}, "None", None),
        ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "null", None),
        ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "7", "7"),
        ({"enum": ["a", 1]}, "1", 1),
        ({"const": "1"}, "1", "1"),
        ({"$ref": "#/$defs/X"}, "[true]", [True]),
        (None, "7", 7),
        (None, "yes", "yes"),
        (None, "Infinity", "Infinity"),
    ],
)  # fmt: skip
def test_xml_values_are_typed_by_the_tools_schema(schema, raw, value):
    assert _typed(schema, raw) == value and type(_typed(schema, raw)) is type(value)


FORCED_ANSWERS = [
    (None, '[{"name":"weather","parameters":{"city":"Paris","days":2}},'
           '{"name":"now","parameters":{}},{"name":"weather","parameters":{"units":["}"]}}]',
     [("weather", '{"city":"Paris","days":2}'), ("now", "{}"), ("weather", '{"units":["}"]}')]),
    (None, '[{"name":"weather","parameters":{"city":"Par', [("weather", '{"city":"Par')]),
    (None, '[{"name":"wea', []),
    ("weather", '{"city":"Paris","when":null}', [("weather", '{"city":"Paris","when":null}')]),
    ("weather", '{"city":"Pa', [("weather", '{"city":"Pa')]),
]  # fmt: skip


@pytest.mark.parametrize(("function", "text", "calls"), FORCED_ANSWERS)
def test_forced_calls_are_the_same_however_the_answer_is_cut(tokenizer, function, text, calls):
    """The grammar's JSON (compact, "name" before "parameters"): a call starts once its name
    is read; its arguments are the model's text of them. An array cut short before any call
    started stays content."""
    make = partial(ForcedToolCalls, function)
    content = "" if calls else text
    for way, pieces in every_way(tokenizer, text):
        got_content, got_pieces = feed(make, pieces)
        assert (got_content, settled(got_pieces)) == (content, calls), way


@pytest.mark.parametrize(("function", "text"), [(f, t) for f, t, _ in FORCED_ANSWERS[::3]])
def test_forced_arguments_go_out_as_they_are_decoded(function, text):
    parser, pieces = ForcedToolCalls(function), []
    for char in text:
        content, new = parser.feed(char)
        assert content == ""
        pieces += new
    assert parser.finish() == ("", [])
    for index in {piece.index for piece in pieces}:
        mine = [piece for piece in pieces if piece.index == index]
        assert mine[0].id is not None and mine[0].arguments == ""
        assert len(mine) > 2, mine


def test_a_chunk_carries_one_entry_per_call():
    """A call's naming piece and its first arguments, settled by one delta, go out as one
    entry (instructor reads only a chunk's first entry: it lost the arguments)."""
    parser = ForcedToolCalls(None)
    _, pieces = parser.feed('[{"name":"now","parameters":{"a":1}},{"name":"now","parameters":{')
    assert len(pieces) == 4
    first, second = joined(pieces)
    assert (first.id is not None, first.index, first.name, first.arguments) == (
        True,
        0,
        "now",
        '{"a":1}',
    )
    assert (second.id is not None, second.index, second.arguments) == (True, 1, "{")
    assert joined([ToolCall(None, None, "x", 1), ToolCall(None, None, "y", 1)]) == [
        ToolCall(None, None, "xy", 1)
    ]
