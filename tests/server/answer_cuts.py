"""A recorded answer fed to the chat answer parsers whole and cut at every point, as a stream
may deliver it: what the parsers make of it must not depend on where the cuts fall."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from pegainfer.server.chat import AnswerParser
from pegainfer.server.tool_calls import ToolCall


def cuts(text: str, step: int) -> Iterator[list[str]]:
    """`text` whole, in two at every point, and in three at every `step`-th pair of points."""
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    for i, j in itertools.combinations_with_replacement(range(0, len(text) + 1, step), 2):
        yield [text[:i], text[i:j], text[j:]]


def feed(parser: AnswerParser, pieces: list[str]) -> tuple[str, str, list[ToolCall]]:
    """The reasoning, content and calls (streamed pieces, as they came) of an answer that
    arrives in `pieces`, the last one ending it."""
    reasoning, content, calls = "", "", []
    for n, piece in enumerate(pieces):
        more = parser.feed(piece, last=n == len(pieces) - 1)
        reasoning, content, calls = reasoning + more[0], content + more[1], calls + more[2]
    return reasoning, content, calls
