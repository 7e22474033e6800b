"""Tool-call parsers: function calls in the model's text turned into OpenAI `tool_calls`.

Qwen models write each call between `<tool_call>` and `</tool_call>`; text outside the tags
is content. Inside, Qwen3 (hermes style) writes a JSON object `{"name": ..., "arguments":
{...}}`; Qwen3.5 and Qwen3-Coder write XML, `<function=NAME>` holding one
`<parameter=KEY>VALUE</parameter>` per argument. Kimi-K2 writes its calls in special tokens,
a section of `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}
<|tool_call_end|>` (see `KimiK2ToolCalls`). GLM-4.5 … GLM-5 write `<tool_call>NAME` then
`<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` per argument, values bare (see
`GlmToolCalls`). Under tool_choice "required" or a named function the model writes JSON the
grammar holds it to (`ForcedToolCalls`), or, for Kimi and GLM, its own format.

Streamed, every call goes out as its arguments arrive, as vLLM's parsers send them: a first
piece with the call's id and name, then pieces of its arguments' JSON, whose concatenation is
exactly the arguments of the same answer parsed whole (a call that arrives whole goes through
the same reading). Text that might be the start of a tag is held back. A body that does not
start as a call stays text, as the model wrote it; one that started going out and is cut short
stays cut short.
"""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from pegainfer.core.errors import InvalidRequestError
from pegainfer.core.sampling.structured_output import StructuredOutput
from pegainfer.server.reasoning import partial_tag_length


@dataclass(frozen=True)
class ToolCall:
    """A call, or a piece of one being streamed: the first piece has the call's id and name,
    later pieces (id None) more of its arguments."""

    id: str | None
    name: str | None
    arguments: str  # JSON text, as OpenAI sends it (a piece of it, streamed)
    index: int | None = None  # its call's place in the answer, where the parser numbers them

    def as_openai(self, index: int | None = None) -> dict:
        if self.id is None:
            return {"index": index, "function": {"arguments": self.arguments}}
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        return call if index is None else {"index": index} | call


def whole_calls(pieces: list[ToolCall]) -> list[ToolCall]:
    """Streamed pieces joined into whole calls (whole calls pass as they are)."""
    calls: list[ToolCall] = []
    started: dict[int | None, int] = {}  # a call's index -> its place in `calls`
    for piece in pieces:
        if piece.id is not None:
            started[piece.index] = len(calls)
            calls.append(replace(piece, index=None))
        else:
            at = started[piece.index]
            calls[at] = replace(calls[at], arguments=calls[at].arguments + piece.arguments)
    return calls


def joined(pieces: list[ToolCall]) -> list[ToolCall]:
    """One delta's pieces with each call's consecutive pieces joined into one: a stream chunk
    carries one entry per call, as OpenAI's and vLLM's do (clients such as instructor read
    only the first entry of a chunk)."""
    out: list[ToolCall] = []
    for piece in pieces:
        if out and piece.id is None and out[-1].index == piece.index:
            out[-1] = replace(out[-1], arguments=out[-1].arguments + piece.arguments)
        else:
            out.append(piece)
    return out


class ToolCallParser(ABC):
    """Splits one answer into content and tool calls as its text arrives."""

    #: The calls are written in special tokens, which the answer's text must then keep
    #: (requests with tools decode with skip_special_tokens off, as vLLM's kimi_k2 parser asks).
    needs_special_tokens: ClassVar[bool] = False

    @classmethod
    def for_request(cls, tools: list[dict[str, Any]]) -> ToolCallParser:
        """The parser of one answer to a request that offers `tools` (OpenAI's tool objects);
        a format that writes arguments untyped reads their types from the tools' schemas."""
        return cls()

    @abstractmethod
    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content and the calls (or, streamed, pieces of calls) this text settles."""

    @abstractmethod
    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is held back when the answer ends."""

    @classmethod
    def forced_output(
        cls, functions: dict[str, dict[str, Any]], name: str | None, parallel: bool
    ) -> StructuredOutput | None:
        """The grammar of tool_choice "required" (`name` None: calls of any of `functions`, one
        unless `parallel`) or of the named function, in this parser's own format: the answer
        then goes through this parser. None: the model writes the calls as JSON instead
        (vLLM's way), which `ForcedToolCalls` reads."""
        return None


class TaggedToolCalls(ToolCallParser):
    """Splits one answer into content and tool calls between tags; subclasses parse a call's
    body."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self) -> None:
        self._held = ""
        self._inside = False
        self._calls = 0  # calls this answer has made (the index of the next one)
        self._streaming = False  # the current call has started going out in pieces

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._held += text
        content, calls = "", []
        while self._held:
            tag = self.end_tag if self._inside else self.start_tag
            at = self._held.find(tag)
            if at < 0:
                if self._inside:  # the call so far: what of it can go out already
                    pieces = self.stream(self._held, done=False)
                    self._streaming = self._streaming or pieces is not None
                    calls += pieces or []
                    break
                keep = partial_tag_length(self._held, tag)
                content += self._held[: len(self._held) - keep]
                self._held = self._held[len(self._held) - keep :]
                break
            if self._inside:
                body = self._held[:at]
                pieces = self.stream(body, done=True) if self._streaming else None
                call = None if pieces is not None else self.parse(body)
                if pieces is not None:
                    calls += pieces
                elif call is None:  # not a call after all: keep the text as the model wrote it
                    content += self.start_tag + body + self.end_tag
                else:
                    calls.append(replace(call, index=self._calls))
                if pieces is not None or call is not None:
                    self._calls += 1
                self._streaming = False
            else:
                content += self._held[:at]
            self._held = self._held[at + len(tag) :]
            self._inside = not self._inside
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is held back when the answer ends: an unclosed call stays text (unless it
        started going out: then it stays cut short)."""
        held, self._held = self._held, ""
        if self._inside:
            self._inside = False
            return ("", []) if self._streaming else (self.start_tag + held, [])
        return held, []

    def stream(self, body: str, done: bool) -> list[ToolCall] | None:
        """Pieces of the call whose text so far is `body` (all of it when `done`); None while
        it does not stream (it then goes out whole, parsed, at its closing tag)."""
        return None

    @abstractmethod
    def parse(self, body: str) -> ToolCall | None:
        """One call from the text between the tags, or None if it is not one."""


# The start of a hermes call whose arguments are a JSON object, up to that object's "{".
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*\{')


class _ObjectEnd:
    """Where a JSON object starting at `start` of a growing text ends, read as it grows."""

    def __init__(self, start: int) -> None:
        self.pos = self.sent = start
        self.depth = 0
        self.in_string = self.escaped = False
        self.end: int | None = None

    def reach(self, text: str) -> int:
        """How far into `text` the object goes so far (its end once it is closed)."""
        while self.end is None and self.pos < len(text):
            char = text[self.pos]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.pos + 1
            self.pos += 1
        return self.pos if self.end is None else self.end


class HermesToolCalls(TaggedToolCalls):
    def __init__(self) -> None:
        super().__init__()
        self._arguments: _ObjectEnd | None = None

    def stream(self, body: str, done: bool) -> list[ToolCall] | None:
        pieces = []
        if self._arguments is None:
            head = _HERMES_HEAD.match(body)
            if head is None:
                return None
            self._arguments = _ObjectEnd(head.end() - 1)
            pieces.append(_call(json.loads(head.group(1)), "", self._calls))
        arguments = self._arguments
        reach = arguments.reach(body)
        if reach > arguments.sent:
            pieces.append(ToolCall(None, None, body[arguments.sent : reach], self._calls))
            arguments.sent = reach
        if done:
            self._arguments = None
        return pieces

    def parse(self, body: str) -> ToolCall | None:
        try:
            parsed = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
            return None
        arguments = parsed.get("arguments", {})
        if isinstance(arguments, str):
            return _call(parsed["name"], arguments)
        return _call(parsed["name"], json.dumps(arguments, ensure_ascii=False))


# The start of an XML call, up to its function's name.
_XML_HEAD = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER_START = "<parameter="
_PARAMETER_END = "</parameter>"
_FUNCTION_END = "</function>"
_BETWEEN, _VALUE, _CLOSED = range(3)


class Qwen3XmlToolCalls(TaggedToolCalls):
    """Qwen3.5's and Qwen3-Coder's calls: `<function=NAME>` then, per argument,
    `<parameter=KEY>` VALUE `</parameter>` (one newline after the opening tag and one before
    the closing tag are layout, not value), then `</function>`.

    A value is written bare; the tool's JSON schema says what it is. A parameter that can
    only be a string streams as it arrives, as the characters of a JSON string; any other
    (a number, a boolean, an object, a parameter the schema does not type) needs its whole
    value to be read, so it goes out once its closing tag arrives: as JSON when it reads as a
    type the schema allows, else as a string where strings are allowed (vLLM's qwen3_xml
    parser streams the same way). The arguments' JSON is written as `json.dumps` writes it.
    """

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__()
        self._properties = {
            tool["function"]["name"]: parameters_schema(tool["function"]).get("properties", {})
            for tool in tools or []
        }
        self._call: _XmlArguments | None = None

    @classmethod
    def for_request(cls, tools: list[dict[str, Any]]) -> Qwen3XmlToolCalls:
        return cls(tools)

    def stream(self, body: str, done: bool) -> list[ToolCall] | None:
        pieces = []
        if self._call is None:
            head = _XML_HEAD.match(body)
            if head is None:
                return None
            name = head.group(1).strip()
            properties = self._properties.get(name)
            self._call = _XmlArguments(head.end(), properties if isinstance(properties, dict)
                                       else {})  # fmt: skip
            pieces.append(_call(name, "", self._calls))
        text = self._call.advance(body, done)
        if text:
            pieces.append(ToolCall(None, None, text, self._calls))
        if done:
            self._call = None
        return pieces

    def parse(self, body: str) -> ToolCall | None:
        """A call that arrived whole, read as it would have streamed."""
        pieces = self.stream(body, done=True)
        return None if pieces is None else whole_calls(pieces)[0]


class _XmlArguments:
    """One XML call's arguments as JSON text, from a growing body: `advance` returns what
    more of it is settled."""

    def __init__(self, start: int, properties: dict[str, Any]) -> None:
        self.properties = properties
        self.pos = start  # how far the body is read
        self.state = _BETWEEN
        self.opened = False  # "{" sent
        self.count = 0  # parameters begun
        self.key = ""
        self.streams = False  # the current value streams as a JSON string
        self.skipped_newline = False  # the current value's leading newline is read

    def advance(self, body: str, done: bool) -> str:
        out = [] if self.opened else ["{"]
        self.opened = True
        while self.state != _CLOSED:
            if self.state == _BETWEEN:
                if not self._next_tag(body, done, out):
                    break
            elif not self._value(body, done, out):
                break
        return "".join(out)

    def _next_tag(self, body: str, done: bool, out: list[str]) -> bool:
        """Past the next parameter's opening tag or the function's end (text between them is
        not an argument); False while neither has arrived."""
        at, tag = _first(body[self.pos :], (_PARAMETER_START, _FUNCTION_END))
        name_end = body.find(">", self.pos + at + len(_PARAMETER_START)) if at >= 0 else -1
        if tag is None or (tag == _PARAMETER_START and name_end < 0):
            if done:  # the call ends without its closing tag
                out.append("}")
                self.state = _CLOSED
            return False
        if tag == _FUNCTION_END:
            out.append("}")
            self.state = _CLOSED
            return True
        self.key = body[self.pos + at + len(_PARAMETER_START) : name_end].strip()
        self.streams = _admitted(self.properties.get(self.key)) == {"string"}
        out.append(", " * (self.count > 0) + json.dumps(self.key, ensure_ascii=False) + ": ")
        if self.streams:
            out.append('"')
        self.count += 1
        self.pos, self.state, self.skipped_newline = name_end + 1, _VALUE, False
        return True

    def _value(self, body: str, done: bool, out: list[str]) -> bool:
        """The current value, or of a streaming one what is settled; False while its closing
        tag has not arrived."""
        if not self.skipped_newline:
            if self.pos == len(body) and not done:
                return False
            self.skipped_newline = True
            if body.startswith("\n", self.pos):
                self.pos += 1
        end = body.find(_PARAMETER_END, self.pos)
        if end < 0 and not done:
            if self.streams:
                # Held back: what may begin the closing tag, a function's end (a value whose
                # closing tag never comes ends there), and a newline that may be the last
                # (layout, not value).
                ready = body.find(_FUNCTION_END, self.pos)
                if ready < 0:
                    ready = len(body) - _partial(body, (_PARAMETER_END, _FUNCTION_END))
                if ready > self.pos and body[ready - 1] == "\n":
                    ready -= 1
                out.append(_json_string_piece(body[self.pos : ready]))
                self.pos = max(self.pos, ready)
            return False
        if end < 0:  # cut short: the value is the rest, up to the function's end if written
            function_end = body.rfind(_FUNCTION_END, self.pos)
            end = len(body) if function_end < 0 else function_end
        value = body[self.pos : end].removesuffix("\n")
        if self.streams:
            out.append(_json_string_piece(value) + '"')
        else:
            typed = _typed(value, _admitted(self.properties.get(self.key)))
            out.append(json.dumps(typed, ensure_ascii=False))
        self.pos, self.state = end + len(_PARAMETER_END), _BETWEEN
        return True


def _json_string_piece(text: str) -> str:
    """`text` as it appears inside a JSON string (JSON escapes each character on its own, so
    the pieces of a string escape to the pieces of its escape)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string",
               list: "array", dict: "object", type(None): "null"}  # fmt: skip


def _admitted(schema: Any) -> set[str] | None:
    """The JSON types a parameter's schema allows (None: any, or not known without following
    references)."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return {_JSON_TYPES[type(schema["const"])]}
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return {_JSON_TYPES[type(value)] for value in schema["enum"]}
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return set(kind)
    for union in ("anyOf", "oneOf"):
        if isinstance(schema.get(union), list):
            members = [_admitted(member) for member in schema[union]]
            return None if any(m is None for m in members) else set().union(*members)
    return None


# Python's spellings, which models trained on Python-rendered templates write.
_PYTHON_LITERALS = {"True": True, "False": False, "None": None}


def _typed(value: str, admitted: set[str] | None) -> Any:
    """A bare value as the type its schema allows: its JSON (or a Python literal) where that
    is of an allowed type, else the string where strings are allowed (or the schema does not
    say), else what it reads as."""
    try:
        parsed = json.loads(value, parse_constant=_no_constant)
    except ValueError:
        parsed = value
    if admitted is None:
        return parsed
    for candidate in (parsed, _PYTHON_LITERALS.get(value.strip(), value)):
        kind = _JSON_TYPES[type(candidate)]
        if kind in admitted or (kind == "integer" and "number" in admitted):
            return candidate
    return value if "string" in admitted else parsed


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity would not write back as JSON


# Kimi-K2's markers, each one special token. The section's singular spelling is a slip the
# model makes that vLLM accepts too.
_SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
_SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
_CALL_BEGIN = "<|tool_call_begin|>"
_ARGUMENTS_BEGIN = "<|tool_call_argument_begin|>"
_CALL_END = "<|tool_call_end|>"
# A call's header: its id, `functions.NAME:IDX` (the `functions.` prefix optional).
_KIMI_HEADER = re.compile(r"\s*([^<\s]+:\d+)\s*")
_TEXT, _SECTION, _HEADER, _ARGUMENTS, _NOT_A_CALL = range(5)


class KimiK2ToolCalls(ToolCallParser):
    """Kimi-K2's calls: after any text, `<|tool_calls_section_begin|>`, then per call
    `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>`,
    then `<|tool_calls_section_end|>`. A call's id is its header, as vLLM's kimi_k2 parser
    gives it (the chat template writes it back in the history); its arguments stream as they
    arrive, without the whitespace around them. Text inside the section but outside the calls
    is dropped (vLLM sends nothing after the section starts); text after it is content again.
    A call whose header is not `NAME:IDX` stays text, markers and all.
    """

    needs_special_tokens = True

    def __init__(self) -> None:
        self._held = ""
        self._state = _TEXT
        self._calls = 0  # calls this answer has made (the index of the next one)
        self._arguments_sent = False  # the current call's arguments have started going out

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._held += text
        content, calls = "", []
        while self._held:
            if self._state == _TEXT:
                at, marker = _first(self._held, _SECTION_BEGIN)
                if marker is None:
                    content += self._take(len(self._held) - _partial(self._held, _SECTION_BEGIN))
                    break
                content += self._take(at)
                self._take(len(marker))
                self._state = _SECTION
            elif self._state == _SECTION:
                at, marker = _first(self._held, (_CALL_BEGIN, *_SECTION_END))
                if marker is None:
                    self._take(len(self._held) - _partial(self._held, (_CALL_BEGIN, *_SECTION_END)))
                    break
                self._take(at + len(marker))
                self._state = _HEADER if marker == _CALL_BEGIN else _TEXT
            elif self._state == _HEADER:
                at, marker = _first(self._held, (_ARGUMENTS_BEGIN, _CALL_END, _CALL_BEGIN,
                                                 *_SECTION_END))  # fmt: skip
                if marker is None:
                    break  # a header is a few tokens: wait for its end
                header = _KIMI_HEADER.fullmatch(self._held[:at])
                if marker != _ARGUMENTS_BEGIN or header is None:
                    content += _CALL_BEGIN  # not a call: its text is content, as written
                    self._state = _NOT_A_CALL
                    continue
                self._take(at + len(marker))
                call_id = header.group(1)
                name = call_id.rsplit(":", 1)[0].rsplit(".", 1)[-1]
                calls.append(ToolCall(call_id, name, "", self._calls))
                self._state, self._arguments_sent = _ARGUMENTS, False
            elif self._state == _ARGUMENTS:
                ends = (_CALL_END, _CALL_BEGIN, *_SECTION_END)
                at, marker = _first(self._held, ends)
                end = at if marker is not None else len(self._held) - _partial(self._held, ends)
                calls += self._arguments(end, done=marker is not None)
                if marker is None:
                    break
                if marker == _CALL_END:  # a call the model did not end is cut short
                    self._take(len(marker))
                self._calls += 1
                self._state = _SECTION
            else:  # _NOT_A_CALL: up to and including its end marker, if it has one
                at, marker = _first(self._held, (_CALL_END, _CALL_BEGIN, *_SECTION_END))
                if marker is None:
                    break
                content += self._take(at + len(marker) if marker == _CALL_END else at)
                self._state = _SECTION
        return content, calls

    def _take(self, length: int) -> str:
        taken, self._held = self._held[:length], self._held[length:]
        return taken

    def _arguments(self, end: int, done: bool) -> list[ToolCall]:
        """The current call's arguments in `_held[:end]` that can go out: without leading
        whitespace, and with trailing whitespace held back until more follows (dropped at the
        call's end)."""
        if not self._arguments_sent:
            stripped = self._held[:end].lstrip()
            self._take(end - len(stripped))
            end = len(stripped)
        ready = self._held[:end].rstrip()
        self._take(end if done else len(ready))
        if not ready:
            return []
        self._arguments_sent = True
        return [ToolCall(None, None, ready, self._calls)]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """An answer that ends inside a call: a call that went out stays cut short (its
        arguments as written so far), a header that never finished stays text."""
        content, calls = "", []
        if self._state == _ARGUMENTS:
            calls = self._arguments(len(self._held), done=True)
        elif self._state == _HEADER:
            content = _CALL_BEGIN + self._held
        elif self._state in (_TEXT, _NOT_A_CALL):
            content = self._held
        self._held, self._state = "", _TEXT
        return content, calls

    @classmethod
    def forced_output(
        cls, functions: dict[str, dict[str, Any]], name: str | None, parallel: bool
    ) -> StructuredOutput:
        """A Lark grammar of one section of calls in Kimi's tokens, each function's
        arguments held to its parameters' JSON schema."""
        names = [name] if name is not None else list(functions)
        rules = []
        for i, function in enumerate(names):
            header = json.dumps(f"functions.{function}:")
            # Compact JSON, as the server's other JSON constraints: no endless whitespace.
            compact = {"x-guidance": {"whitespace_flexible": False}}
            schema = json.dumps(parameters_schema(functions[function]) | compact)
            rules.append(f"call{i}: {_CALL_BEGIN} {header} INDEX {_ARGUMENTS_BEGIN} "
                         f"args{i} {_CALL_END}\nargs{i}: %json {schema}")  # fmt: skip
        calls = " | ".join(f"call{i}" for i in range(len(names)))
        repeat = "+" if parallel and name is None else ""
        grammar = "\n".join([
            f"start: {_SECTION_BEGIN[0]} call{repeat} {_SECTION_END[0]}",
            f"call: {calls}",
            *rules,
            "INDEX: /[0-9]{1,4}/",
        ])  # fmt: skip
        return StructuredOutput(kind="grammar", spec=grammar)


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """Where the first of `markers` starts in `text`, and which one (-1 and None: none)."""
    found = [(at, marker) for marker in markers if (at := text.find(marker)) >= 0]
    return min(found) if found else (-1, None)


def _partial(text: str, markers: tuple[str, ...]) -> int:
    """How much of `text`'s end may be the start of one of `markers` (to hold back)."""
    return max(partial_tag_length(text, marker) for marker in markers)


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema (any object when it gives none)."""
    parameters = function.get("parameters")
    return parameters if isinstance(parameters, dict) and parameters else {"type": "object"}


# The start of a call in tool_choice "required"'s array, up to its parameters' "{": after the
# array's "[" or, past the previous call's object, a ",". The grammar writes "name" first.
_REQUIRED_HEAD = re.compile(
    r'\s*\}?\s*[\[,]\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*\{'
)


class ForcedToolCalls(ToolCallParser):
    """The answer to tool_choice "required" (a JSON array of `{"name", "parameters"}`) or a
    named function (its arguments as JSON), which constrained decoding made the model write,
    streamed as it arrives: a named function's call starts with the answer and its arguments
    are the answer's text; each call in the array starts once its name is read, and its
    arguments are its parameters' text. An answer cut short (max_tokens) ends its last call
    where it stops; one in which no call started stays content."""

    def __init__(self, function: str | None) -> None:
        self.function = function
        self._held = ""  # the answer so far (an array's: from where it is not yet read)
        self._calls = 0  # calls started
        self._arguments: _ObjectEnd | None = None  # the current call's, in an array

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.function is not None:
            return "", self._named(self.function, text)
        self._held += text
        calls = []
        while True:
            if self._arguments is None:
                head = _REQUIRED_HEAD.match(self._held)
                if head is None:
                    break
                self._arguments = _ObjectEnd(head.end() - 1)
                calls.append(_call(json.loads(head.group(1)), "", self._calls))
                self._calls += 1
            arguments = self._arguments
            reach = arguments.reach(self._held)
            if reach > arguments.sent:
                calls.append(ToolCall(None, None, self._held[arguments.sent : reach],
                                      self._calls - 1))  # fmt: skip
                arguments.sent = reach
            if arguments.end is None:
                break
            self._held, self._arguments = self._held[arguments.end :], None
        return "", calls

    def _named(self, function: str, text: str) -> list[ToolCall]:
        if not text:
            return []
        calls = [] if self._calls else [_call(function, "", 0)]
        self._calls = 1
        return [*calls, ToolCall(None, None, text, 0)]

    def finish(self) -> tuple[str, list[ToolCall]]:
        held, self._held = self._held, ""
        return ("", []) if self._calls else (held, [])


def _call(name: str, arguments: str, index: int | None = None) -> ToolCall:
    return ToolCall(f"call_{secrets.token_hex(12)}", name, arguments, index)


# GLM's argument tags (plain text in its tokenizer, not special tokens).
_ARG_KEY, _ARG_KEY_END = "<arg_key>", "</arg_key>"
_ARG_VALUE, _ARG_VALUE_END = "<arg_value>", "</arg_value>"
_GLM_NAME = re.compile(r"[^\s<>]+")
_NAME, _GAP, _KEY, _VALUE_GAP, _VALUE = range(5)


class GlmToolCalls(TaggedToolCalls):
    """GLM-4.5 … GLM-5's calls (vLLM's glm45 and glm47 parsers): `<tool_call>NAME`, then per
    argument `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>`, then `</tool_call>`; GLM-4.5
    and 4.6 put a newline after the name and between the tags, GLM-4.7 and 5 nothing. Values are
    written bare and typed by the tool's schema as qwen3_xml's are: a parameter that can only be
    a string is its text as written and streams as it arrives; any other goes out once its
    closing tag is in, read (stripped) as the JSON type its schema allows."""

    # GLM's tokenizers leave the tags out of the special tokens; vLLM's glm45/glm47 decode with
    # special tokens kept all the same, lest a checkpoint that counts them special lose its calls.
    needs_special_tokens = True

    def __init__(self, parameters: dict[str, dict[str, Any]] | None = None) -> None:
        super().__init__()
        self._parameters = parameters or {}  # function -> its parameters' schema
        self._reader: _GlmArguments | None = None

    @classmethod
    def for_request(cls, tools: list[dict[str, Any]]) -> ToolCallParser:
        return cls({t["function"]["name"]: parameters_schema(t["function"]) for t in tools})

    def stream(self, body: str, done: bool) -> list[ToolCall] | None:
        if self._reader is None:
            self._reader = _GlmArguments(self._parameters)
        reader = self._reader
        was_named = reader.name is not None
        arguments = reader.read(body, done)
        if done:
            self._reader = None
        if reader.name is None:
            return None
        pieces = [] if was_named else [_call(reader.name, "", self._calls)]
        return pieces + [ToolCall(None, None, a, self._calls) for a in arguments if a]

    def parse(self, body: str) -> ToolCall | None:
        self._reader = None  # the call arrived whole: read it afresh
        reader = _GlmArguments(self._parameters)
        arguments = "".join(reader.read(body, done=True))
        return None if reader.name is None else _call(reader.name, arguments)

    @classmethod
    def forced_output(
        cls, functions: dict[str, dict[str, Any]], name: str | None, parallel: bool
    ) -> StructuredOutput:
        """A Lark grammar of calls in GLM's tags, each argument's value held to its
        parameter's schema: string parameters bare text, any other compact JSON. Required
        parameters come first, then the optional ones, each in the schema's order."""
        names = [name] if name is not None else list(functions)
        rules = []
        for i, function in enumerate(names):
            arguments = _glm_argument_rules(f"args{i}", parameters_schema(functions[function]))
            call = f"call{i}: {_LARK_CALL_BEGIN} {json.dumps(function)} args{i} {_LARK_CALL_END}"
            rules += [call, *arguments]
        repeat = "+" if parallel and name is None else ""
        grammar = "\n".join([
            f"start: call{repeat}",
            "call: " + " | ".join(f"call{i}" for i in range(len(names))),
            *rules,
            f"VALUE: {_BARE_VALUE}",
            "KEY: /[^<>]+/",
        ])  # fmt: skip
        return StructuredOutput(kind="grammar", spec=grammar)


# GLM's tags are added tokens that are not special, so a grammar holds them as text (quoted
# Lark strings): the model writes each as its one token or, read alike, in pieces. A bare
# value is any text that does not write one of the closing tags, lexed with the tag that ends
# it: a lexeme of the text alone would take the tag's first characters too (lexemes are
# greedy, and `</arg_value` is text), leaving a `>` no rule allows.
_GLM_CALL_END = GlmToolCalls.end_tag
_LARK_CALL_BEGIN, _LARK_CALL_END = json.dumps(GlmToolCalls.start_tag), json.dumps(_GLM_CALL_END)
_LARK_ARG_KEY, _LARK_ARG_KEY_END = json.dumps(_ARG_KEY), json.dumps(_ARG_KEY_END)
_LARK_ARG_VALUE, _LARK_ARG_VALUE_END = json.dumps(_ARG_VALUE), json.dumps(_ARG_VALUE_END)
_BARE_TEXT = r"/(?s:.*)/ & ~/(?s:.*)(<\/arg_value>|<\/tool_call>)(?s:.*)/"
_BARE_VALUE = f"({_BARE_TEXT}) {_LARK_ARG_VALUE_END}"
# The keywords a bare string value can be held to; others (a pattern, a format) would need
# JSON's quoted strings, which GLM does not write.
_BARE_STRING_KEYWORDS = frozenset({"type", "enum", "const", "minLength", "maxLength",
                                   "title", "description", "default", "examples"})  # fmt: skip


def _glm_argument_rules(rule: str, parameters: dict[str, Any]) -> list[str]:
    """Lark rules for one function's arguments (`rule`: their sequence)."""
    properties = parameters.get("properties") or {}
    if not properties:  # no declared parameters: any, unless the schema allows none
        if parameters.get("additionalProperties") is False:
            return [f'{rule}: ""']
        return [f"{rule}: ({_LARK_ARG_KEY} KEY {_LARK_ARG_KEY_END} {_LARK_ARG_VALUE} VALUE)*"]
    required = set(parameters.get("required") or ())
    order = [k for k in properties if k in required] + [k for k in properties if k not in required]
    rules, parts = [], []
    defs = {"$defs": parameters["$defs"]} if "$defs" in parameters else {}
    for j, key in enumerate(order):
        value = f"{rule}_{j}"
        rules.append(f"{value}: {_glm_value(value.upper(), key, properties[key], defs, rules)}")
        pair = f"{_LARK_ARG_KEY} {json.dumps(key)} {_LARK_ARG_KEY_END} {_LARK_ARG_VALUE} {value}"
        parts.append(pair if key in required else f"({pair})?")
    return [f"{rule}: " + " ".join(parts), *rules]


def _glm_value(terminal: str, key: str, schema: Any, defs: dict[str, Any], rules: list[str]) -> str:
    """The Lark expansion of one parameter's value and its closing tag (a terminal it needs,
    named `terminal`, is added to `rules`)."""
    if _admitted(schema) != {"string"}:  # written as JSON (what the parser reads it as)
        compact = {"x-guidance": {"whitespace_flexible": False}}
        schema = (schema if isinstance(schema, dict) else {}) | defs | compact
        return f"%json {json.dumps(schema)} {_LARK_ARG_VALUE_END}"
    unsupported = sorted(set(schema) - _BARE_STRING_KEYWORDS)
    if unsupported:
        raise InvalidRequestError(
            f"tool_choice cannot hold string parameter {key!r} to {', '.join(unsupported)}: "
            "GLM writes string values bare, not as JSON strings", "tool_choice")  # fmt: skip
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        choices = " | ".join(json.dumps(v, ensure_ascii=False) for v in values)
        return f"({choices}) {_LARK_ARG_VALUE_END}"
    low, high = schema.get("minLength"), schema.get("maxLength")
    if low is None and high is None:
        return "VALUE"
    length = f"{{{int(low or 0)},{'' if high is None else int(high)}}}"
    rules.append(f"{terminal}: (/(?s:.{length})/ & {_BARE_TEXT}) {_LARK_ARG_VALUE_END}")
    return terminal


class _GlmArguments:
    """One GLM call's body read as it grows: its name, then its arguments as pieces of JSON
    text whose concatenation, once the call is done, is the whole call's arguments."""

    def __init__(self, parameters: dict[str, dict[str, Any]]) -> None:
        self._parameters = parameters
        self.name: str | None = None
        self._state, self._pos = _NAME, 0
        self._key = ""
        self._value_at = 0  # where the current value starts
        self._pairs = 0  # arguments begun so far

    def read(self, body: str, done: bool) -> list[str]:
        """The arguments' JSON that `body` (the call so far; all of it when `done`) adds."""
        out: list[str] = []
        while True:
            if self._state == _NAME:
                start = len(body) - len(body.lstrip())
                ends = [at for tag in ("\n", _ARG_KEY) if (at := body.find(tag, start)) >= 0]
                if not ends and not done:
                    return out
                end = min(ends, default=len(body))
                if not _GLM_NAME.fullmatch(name := body[start:end].strip()):
                    return out  # not a call: the name stays None
                self.name, self._pos, self._state = name, end, _GAP
            elif self._state in (_GAP, _KEY, _VALUE_GAP):
                tag = {_GAP: _ARG_KEY, _KEY: _ARG_KEY_END, _VALUE_GAP: _ARG_VALUE}[self._state]
                at = body.find(tag, self._pos)
                if at < 0:
                    break  # a pair cut before its value is left out
                if self._state == _KEY:
                    self._key = body[self._pos : at].strip()
                self._pos = at + len(tag)
                self._state += 1
                if self._state == _VALUE:
                    self._value_at = self._pos
                    if self._is_string():
                        out.append(self._pair_head() + '"')
            else:  # _VALUE
                at = body.find(_ARG_VALUE_END, self._pos)
                end = at if at >= 0 else len(body)
                if at < 0 and not done:
                    # Hold back what may be the start of a closing tag (the value's or the call's).
                    end -= _partial(body[self._pos :], (_ARG_VALUE_END, _GLM_CALL_END))
                if self._is_string():
                    out.append(_json_string_piece(body[self._pos : end]))
                    self._pos = end
                if at < 0 and not done:
                    return out
                if self._is_string():
                    out.append('"')
                else:  # GLM pads no value; whitespace around a non-string one is layout
                    typed = _typed(body[self._value_at : end].strip(), self._admitted())
                    out.append(self._pair_head() + json.dumps(typed, ensure_ascii=False))
                self._pos, self._state = (at + len(_ARG_VALUE_END) if at >= 0 else end), _GAP
        if done:
            out.append("}" if self._pairs else "{}")
        return out

    def _admitted(self) -> set[str] | None:
        properties = self._parameters.get(self.name or "", {}).get("properties") or {}
        return _admitted(properties.get(self._key))

    def _is_string(self) -> bool:
        """The current parameter can only be a string: its value streams as it arrives."""
        return self._admitted() == {"string"}

    def _pair_head(self) -> str:
        """`{"key": ` for the first argument, `, "key": ` for the others."""
        self._pairs += 1
        key = json.dumps(self._key, ensure_ascii=False)
        return ("{" if self._pairs == 1 else ", ") + key + ": "


TOOL_CALL_PARSERS = {
    "hermes": HermesToolCalls,
    "qwen3_xml": Qwen3XmlToolCalls,
    "kimi_k2": KimiK2ToolCalls,
    # vLLM's names: glm45 reads GLM-4.5/4.6's layout, glm47 GLM-4.7/5's; this one reads both.
    "glm45": GlmToolCalls,
    "glm47": GlmToolCalls,
}
