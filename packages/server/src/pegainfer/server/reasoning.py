"""Reasoning parsers: the model's thinking split from its answer (`reasoning_content`).

Qwen3 thinks inside `<think>…</think>` at the start of its answer (with thinking off its chat
template already closes an empty block in the prompt, so the answer holds no tags). The split
works on text as it streams: a tag cut across two deltas is held back, never shown as text.
"""

from __future__ import annotations

BEFORE, INSIDE, CLOSED, AFTER = "before", "inside", "closed", "after"


class ThinkSplitter:
    """Splits one answer into (reasoning, content) as its text arrives."""

    start_tag = "<think>"
    end_tag = "</think>"

    def __init__(self) -> None:
        self._state = BEFORE
        self._held = ""

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
                    self._state = AFTER
            elif self._state == INSIDE:
                end = self._held.find(self.end_tag)
                if end >= 0:
                    reasoning += self._held[:end]
                    self._held = self._held[end + len(self.end_tag) :]
                    self._state = CLOSED
                    continue
                keep = partial_tag_length(self._held, self.end_tag)
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


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`: text to hold
    back while streaming, since the next delta may complete the tag."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


REASONING_PARSERS = {"qwen3": ThinkSplitter}
