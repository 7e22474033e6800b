"""Tool-call parsers: function calls in the model's text turned into OpenAI `tool_calls`.

Qwen models write each call between `<tool_call>` and `</tool_call>`; text outside the tags
is content. Inside, Qwen3 (hermes style) writes a JSON object `{"name": ..., "arguments":
{...}}`; Qwen3.5 and Qwen3-Coder write XML, `<function=NAME>` holding one
`<parameter=KEY>VALUE</parameter>` per argument. Streamed, a call is emitted whole once its
closing tag arrives (OpenAI clients accept the arguments in one piece); text that might be the
start of a tag is held back. A body that does not parse stays text, as the model wrote it.
"""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass

from pegainfer.server.reasoning import partial_tag_length


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        return call if index is None else {"index": index} | call


class TaggedToolCalls(ABC):
    """Splits one answer into content and tool calls as its text arrives; subclasses parse a
    call's body."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self) -> None:
        self._held = ""
        self._inside = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content and the complete calls this text settles."""
        self._held += text
        content, calls = "", []
        while self._held:
            tag = self.end_tag if self._inside else self.start_tag
            at = self._held.find(tag)
            if at < 0:
                if self._inside:
                    break  # the call's JSON so far: wait for its end
                keep = partial_tag_length(self._held, tag)
                content += self._held[: len(self._held) - keep]
                self._held = self._held[len(self._held) - keep :]
                break
            if self._inside:
                body = self._held[:at]
                call = self.parse(body)
                if call is None:  # not a call after all: keep the text as the model wrote it
                    content += self.start_tag + body + self.end_tag
                else:
                    calls.append(call)
            else:
                content += self._held[:at]
            self._held = self._held[at + len(tag) :]
            self._inside = not self._inside
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is held back when the answer ends: an unclosed call stays text."""
        held, self._held = self._held, ""
        if self._inside:
            self._inside = False
            return self.start_tag + held, []
        return held, []

    @abstractmethod
    def parse(self, body: str) -> ToolCall | None:
        """One call from the text between the tags, or None if it is not one."""


class HermesToolCalls(TaggedToolCalls):
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


def _call(name: str, arguments: str) -> ToolCall:
    return ToolCall(f"call_{secrets.token_hex(12)}", name, arguments)


TOOL_CALL_PARSERS = {"hermes": HermesToolCalls, "qwen3_xml": Qwen3XmlToolCalls}
