"""Tool-call parsers: function calls in the model's text turned into OpenAI `tool_calls`.

Qwen models write each call between `<tool_call>` and `</tool_call>`; text outside the tags
is content. Inside, Qwen3 (hermes style) writes a JSON object `{"name": ..., "arguments":
{...}}`; Qwen3.5 and Qwen3-Coder write XML, `<function=NAME>` holding one
`<parameter=KEY>VALUE</parameter>` per argument. Streamed, a hermes call goes out as its
arguments arrive (as vLLM's parsers send them: a first piece with the call's id and name, then
pieces of its arguments' JSON); other calls go out whole once their closing tag arrives. Text
that might be the start of a tag is held back. A body that does not parse (and has not started
streaming) stays text, as the model wrote it.
"""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

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


class TaggedToolCalls(ABC):
    """Splits one answer into content and tool calls as its text arrives; subclasses parse a
    call's body."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self) -> None:
        self._held = ""
        self._inside = False
        self._calls = 0  # calls this answer has made (the index of the next one)
        self._streaming = False  # the current call has started going out in pieces

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content and the calls (or, streamed, pieces of calls) this text settles."""
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


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3XmlToolCalls(TaggedToolCalls):
    def parse(self, body: str) -> ToolCall | None:
        function = _FUNCTION.fullmatch(body)
        if function is None:
            return None
        arguments = {}
        for key, raw in _PARAMETER.findall(function.group(2)):
            value = raw.removeprefix("\n").removesuffix("\n")
            # Values are written bare: numbers, booleans, lists and objects read as JSON,
            # anything else is a string.
            try:
                arguments[key.strip()] = json.loads(value)
            except json.JSONDecodeError:
                arguments[key.strip()] = value
        return _call(function.group(1).strip(), json.dumps(arguments, ensure_ascii=False))


class ForcedToolCalls:
    """The answer to tool_choice "required" (a JSON array of `{"name", "parameters"}`) or a
    named function (its arguments as JSON), which constrained decoding made the model write:
    held back until the answer ends, then read as calls. Text that does not read as calls (an
    answer cut short by max_tokens) stays content."""

    def __init__(self, function: str | None) -> None:
        self.function = function
        self._held = ""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._held += text
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        held, self._held = self._held, ""
        try:
            parsed = json.loads(held)
        except json.JSONDecodeError:
            return held, []
        if self.function is not None:
            return "", [_call(self.function, json.dumps(parsed, ensure_ascii=False))]
        if not isinstance(parsed, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in parsed
        ):
            return held, []
        calls = [_call(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
                 for c in parsed]  # fmt: skip
        return "", calls


def _call(name: str, arguments: str, index: int | None = None) -> ToolCall:
    return ToolCall(f"call_{secrets.token_hex(12)}", name, arguments, index)


TOOL_CALL_PARSERS = {"hermes": HermesToolCalls, "qwen3_xml": Qwen3XmlToolCalls}
