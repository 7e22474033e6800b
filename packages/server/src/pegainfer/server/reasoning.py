"""Reasoning parsers: the model's thinking split from its answer (`reasoning_content`).

Qwen3 thinks inside `<think>…</think>` at the start of its answer (with thinking off its chat
template already closes an empty block in the prompt, so the answer holds no tags). Kimi-K2's
thinking models think from the answer's first token, `<think>` optional, until `</think>` or a
tool-call section (vLLM's kimi_k2 parser); `chat_template_kwargs` `thinking: false` turns the
split off. GLM-5 thinks the same way, until `</think>` or a tool call (`enable_thinking: false`
turns it off). The split works on text as it streams: a tag cut across two deltas is held back,
never shown as text.
"""

from __future__ import annotations

from typing import Any, ClassVar

BEFORE, INSIDE, CLOSED, AFTER = "before", "inside", "closed", "after"


class ThinkSplitter:
    """Splits one answer into (reasoning, content) as its text arrives."""

    start_tag = "<think>"
    end_tag = "</think>"
    #: An answer that does not open with `start_tag` is reasoning all the same (else content).
    starts_inside: ClassVar[bool] = False
    #: Markers that end the reasoning without closing it; they stay in the content.
    implicit_ends: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._state = BEFORE
        self._held = ""

    @classmethod
    def for_request(cls, chat_template_kwargs: dict[str, Any]) -> ThinkSplitter:
        """The splitter of one answer to a request rendered with `chat_template_kwargs`."""
        return cls()

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content this text settles (held-back text may come later)."""
        self._held += text
        reasoning = content = ""
        while self._held:
            if self._state == BEFORE:
                stripped = self._held.lstrip()
                if stripped.startswith(self.start_tag):
                    self._held = stripped[len(self.start_tag) :]
                    self._state = INSIDE
                elif self.start_tag.startswith(stripped):
                    break  # could still become the opening tag
                else:
                    self._state = INSIDE if self.starts_inside else AFTER
            elif self._state == INSIDE:
                ends = [(at, tag) for tag in (self.end_tag, *self.implicit_ends)
                        if (at := self._held.find(tag)) >= 0]  # fmt: skip
                if ends:
                    end, tag = min(ends)
                    reasoning += self._held[:end]
                    if tag == self.end_tag:
                        self._held = self._held[end + len(tag) :]
                        self._state = CLOSED
                    else:
                        self._held = self._held[end:]
                        self._state = AFTER
                    continue
                keep = max(partial_tag_length(self._held, tag)
                           for tag in (self.end_tag, *self.implicit_ends))  # fmt: skip
                reasoning += self._held[: len(self._held) - keep]
                self._held = self._held[len(self._held) - keep :]
                break
            elif self._state == CLOSED:  # the newlines after the closing tag are layout
                self._held = self._held.lstrip("\n")
                if self._held:
                    self._state = AFTER
            else:
                content += self._held
                self._held = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Whatever is held back once the answer ends: a truncated thought stays reasoning."""
        held, self._held = self._held, ""
        if self._state == INSIDE:
            return held, ""
        return "", held


class OpenThinkSplitter(ThinkSplitter):
    """Answers to a chat template that leaves the thinking open: reasoning from the first token
    (a `<think>` there is dropped) until `</think>`, or until one of `implicit_ends` (a tool call
    starting, which the tool-call parser then reads); all content when the request turned
    thinking off with the template's `switch` (the template then closes the block itself)."""

    starts_inside = True
    #: The chat_template_kwargs flag the template turns thinking off with (on by default).
    switch: ClassVar[str]

    def __init__(self, thinking: bool = True) -> None:
        super().__init__()
        if not thinking:
            self._state = AFTER

    @classmethod
    def for_request(cls, chat_template_kwargs: dict[str, Any]) -> ThinkSplitter:
        return cls(thinking=bool(chat_template_kwargs.get(cls.switch, True)))


class KimiK2ThinkSplitter(OpenThinkSplitter):
    """Kimi-K2-Thinking's answers (vLLM's kimi_k2): `thinking: false` turns it off; a tool-call
    section ends the thinking."""

    switch = "thinking"
    implicit_ends = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")


class GlmThinkSplitter(OpenThinkSplitter):
    """GLM-4.5 … GLM-5's answers (vLLM's glm45): GLM-5's template opens `<think>` in the
    prompt, GLM-4.5's lets the model write it; `enable_thinking: false` turns it off (the
    template closes an empty block in the prompt); a tool call ends the thinking (a call forced
    by tool_choice starts the answer)."""

    switch = "enable_thinking"
    implicit_ends = ("<tool_call>",)


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`: text to hold
    back while streaming, since the next delta may complete the tag."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


REASONING_PARSERS = {
    "qwen3": ThinkSplitter,
    "kimi_k2": KimiK2ThinkSplitter,
    "glm45": GlmThinkSplitter,
}
