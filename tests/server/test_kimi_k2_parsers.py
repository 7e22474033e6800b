"""Kimi-K2's tool calls and reasoning split: recorded answers in Kimi's format, parsed whole and
cut at every point (streamed pieces reassemble to the whole), plain text untouched, malformed
calls left as text; tool_choice "required" and named constrained to Kimi's own format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pegainfer.core.sampling.structured_output import Grammars
from pegainfer.core.text.tokenizer import Tokenizer
from pegainfer.server.chat import AnswerParser
from pegainfer.server.reasoning import KimiK2ThinkSplitter
from pegainfer.server.structured import forced_tool_calls
from pegainfer.server.tool_calls import KimiK2ToolCalls, ToolCall, whole_calls
from tests.server.answer_cuts import cuts, feed

BEGIN, END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"


def call(header: str, arguments: str) -> str:
    return f"<|tool_call_begin|>{header}<|tool_call_argument_begin|>{arguments}<|tool_call_end|>"


WEATHER = call("functions.get_weather:0", '{"city": "北京", "days": 2}')
TIME = call(" functions.get_time:1 ", '\n {"zone": "UTC+8"} \n')
# (answer, content, calls as (id, name, arguments)), as Kimi-K2 writes them
TOOL_CASES = [
    (BEGIN + WEATHER + END, "",
     [("functions.get_weather:0", "get_weather", '{"city": "北京", "days": 2}')]),
    ("Let me check both." + BEGIN + WEATHER + TIME + END, "Let me check both.",
     [("functions.get_weather:0", "get_weather", '{"city": "北京", "days": 2}'),
      ("functions.get_time:1", "get_time", '{"zone": "UTC+8"}')]),
    ("Plain text, <|tool_call|> and <|im_end no calls.",
     "Plain text, <|tool_call|> and <|im_end no calls.", []),
    # a section the model did not close: what came after it is still read
    (BEGIN + "\n" + WEATHER + "\n", "",
     [("functions.get_weather:0", "get_weather", '{"city": "北京", "days": 2}')]),
    # text after the section is content again
    (BEGIN + WEATHER + END + " Done.", " Done.",
     [("functions.get_weather:0", "get_weather", '{"city": "北京", "days": 2}')]),
    # vLLM's header without the functions. prefix, and the singular section spelling
    ("<|tool_call_section_begin|>" + call("get_time:3", "{}") + "<|tool_call_section_end|>", "",
     [("get_time:3", "get_time", "{}")]),
    # a header that is not NAME:IDX stays text; the good call after it is read
    (BEGIN + call("functions.get_weather", '{"city": "x"}') + WEATHER + END,
     call("functions.get_weather", '{"city": "x"}'),
     [("functions.get_weather:0", "get_weather", '{"city": "北京", "days": 2}')]),
    # a call the model did not end before the next one is cut there
    (BEGIN + WEATHER.removesuffix("<|tool_call_end|>") + TIME + END, "",
     [("functions.get_weather:0", "get_weather", '{"city": "北京", "days": 2}'),
      ("functions.get_time:1", "get_time", '{"zone": "UTC+8"}')]),
    # max_tokens inside the arguments: the call stays cut short
    ("Hm." + BEGIN + WEATHER.split(", ")[0] + ", ", "Hm.",
     [("functions.get_weather:0", "get_weather", '{"city": "北京",')]),
    # max_tokens inside a header: nothing went out, it stays text
    (BEGIN + "<|tool_call_begin|>functions.get_wea", "<|tool_call_begin|>functions.get_wea", []),
    ("<|tool_calls_sec", "<|tool_calls_sec", []),
]  # fmt: skip


def parse(pieces: list[str]) -> tuple[str, list[tuple[str, str, str]], list[ToolCall]]:
    _, content, calls = feed(AnswerParser(None, KimiK2ToolCalls), pieces)
    whole = [(c.id, c.name, c.arguments) for c in whole_calls(calls)]
    return content, whole, calls


@pytest.mark.parametrize(("text", "content", "calls"), TOOL_CASES)
def test_calls_whole_and_cut_anywhere(text, content, calls):
    for pieces in cuts(text, step=7):
        assert parse(pieces)[:2] == (content, calls), pieces


def test_arguments_stream_as_they_arrive():
    text = "Sure." + BEGIN + WEATHER + TIME + END
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    parser = AnswerParser(None, KimiK2ToolCalls)
    seen: list[list[ToolCall]] = [parser.feed(p, last=n == len(pieces) - 1)[2]
                                  for n, p in enumerate(pieces)]  # fmt: skip
    first = next(n for n, calls in enumerate(seen) if calls)
    assert seen[first][0] == ToolCall("functions.get_weather:0", "get_weather", "", 0)
    arguments = [c for calls in seen for c in calls if c.id is None and c.index == 0]
    assert len(arguments) > 3  # in pieces, each out before the call's end arrived
    assert "".join(c.arguments for c in arguments) == '{"city": "北京", "days": 2}'
    assert [c.index for calls in seen for c in calls if c.id is not None] == [0, 1]


def test_parallel_false_keeps_the_first_call():
    text = BEGIN + WEATHER + TIME + END
    for i in range(0, len(text) + 1, 3):
        parser, calls = AnswerParser(None, KimiK2ToolCalls, max_calls=1), []
        for n, piece in enumerate((text[:i], text[i:])):
            calls += parser.feed(piece, last=n == 1)[2]
        assert [c.name for c in whole_calls(calls)] == ["get_weather"], i


THINKING_CASES = [
    # (answer, chat_template_kwargs, reasoning, content, calls' names)
    ("<think>The user wants weather.</think>It is sunny.", {}, "The user wants weather.",
     "It is sunny.", []),
    ("No opening tag.</think>\n\nAnswer.", {}, "No opening tag.", "Answer.", []),
    ("Need a tool." + BEGIN + WEATHER + END, {}, "Need a tool.", "", ["get_weather"]),
    ("<think>plan</think>" + BEGIN + WEATHER + END, {}, "plan", "", ["get_weather"]),
    ("Cut short while thinking", {}, "Cut short while thinking", "", []),
    ("Just an answer.", {"thinking": False}, "", "Just an answer.", []),
    ("Look: " + BEGIN + WEATHER + END, {"thinking": False}, "", "Look: ", ["get_weather"]),
]  # fmt: skip


@pytest.mark.parametrize(("text", "kwargs", "reasoning", "content", "names"), THINKING_CASES)
def test_reasoning_split_cut_anywhere(text, kwargs, reasoning, content, names):
    for pieces in cuts(text, step=7):
        parser = AnswerParser(lambda: KimiK2ThinkSplitter.for_request(kwargs), KimiK2ToolCalls)
        got_reasoning, got_content, calls = feed(parser, pieces)
        assert (got_reasoning, got_content, [c.name for c in whole_calls(calls)]) == (
            reasoning, content, names), pieces  # fmt: skip


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time"}},
]  # fmt: skip


@pytest.fixture(scope="module")
def kimi_tokenizer(tmp_path_factory) -> Tokenizer:
    pytest.importorskip("pegainfer.models.kimi_k2")
    from pegainfer.models.kimi_k2.tiny_tokenizer import write_tiny_kimi_tokenizer
    from pegainfer.models.kimi_k2.tokenizer import load_kimi_tokenizer

    out: Path = tmp_path_factory.mktemp("kimi-tokenizer")
    write_tiny_kimi_tokenizer(out)
    return load_kimi_tokenizer(out)


def accepts(tokenizer: Tokenizer, output, text: str) -> bool:
    """Whether the grammar takes `text` (as the model writes it: markers as their tokens)
    and then the end of the answer."""
    eos = tokenizer.eos_token_id
    matcher = Grammars(lambda: tokenizer, tokenizer.vocab_size).matcher(output, [eos])
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.consume_token(eos)


COMPACT = call("functions.get_weather:0", '{"city":"北京","days":2}')


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "good", "bad"),
    [
        ("required", True, [BEGIN + COMPACT + call("functions.get_time:12", "{}") + END],
         [BEGIN + END, BEGIN + call("functions.get_date:0", "{}") + END,
          BEGIN + call("functions.get_weather:0", '{"days":2}') + END, COMPACT,
          BEGIN + WEATHER + END,  # JSON is compact: no room for endless whitespace
          BEGIN + call("functions.get_time:12345", "{}") + END]),
        ("required", False, [BEGIN + COMPACT + END],
         [BEGIN + COMPACT + call("functions.get_time:1", "{}") + END]),
        ({"type": "function", "function": {"name": "get_time"}}, True,
         [BEGIN + call("functions.get_time:0", '{"zone":"Z"}') + END],
         [BEGIN + COMPACT + END, "Sure." + BEGIN + call("functions.get_time:0", "{}") + END]),
    ],
)  # fmt: skip
def test_forced_calls_are_written_in_kimis_format(kimi_tokenizer, tool_choice, parallel, good,
                                                  bad):  # fmt: skip
    output, make_parser = forced_tool_calls(TOOLS, tool_choice, parallel, KimiK2ToolCalls)
    assert output.kind == "grammar" and isinstance(make_parser(), KimiK2ToolCalls)
    for text in good:
        assert accepts(kimi_tokenizer, output, text), text
        content, calls, _ = parse([text])
        assert content == "" and calls and all(json.loads(c[2]) is not None for c in calls)
    for text in bad:
        assert not accepts(kimi_tokenizer, output, text), text


def test_other_parsers_keep_vllms_json_form():
    output, make_parser = forced_tool_calls(TOOLS, "required", True, None)
    assert output.kind == "json_schema"
    parser = make_parser()
    content, pieces = parser.feed('[{"name": "get_time", "parameters": {}}]')
    assert content == "" and parser.finish() == ("", [])
    assert [(c.name, c.arguments) for c in whole_calls(pieces)] == [("get_time", "{}")]
