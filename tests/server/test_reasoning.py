"""Reasoning split: `<think>…</think>` into reasoning_content, whole or streamed in pieces."""

from __future__ import annotations

import itertools

import openai
import pytest

from pegainfer.server.chat import AnswerParser
from pegainfer.server.reasoning import ThinkSplitter
from tests.server.conftest import start_server, stop_server

CASES = [
    ("<think>\nTwo plus two.\n</think>\n\nIt is 4.", "\nTwo plus two.\n", "It is 4."),
    ("The answer is 4, no <think> here.", None, "The answer is 4, no <think> here."),
    ("<think>\nStill thinking when the tokens ran o", "\nStill thinking when the tokens ran o", ""),
    ("  <think>x</think>y</think>", "x", "y</think>"),
    ("<thin", None, "<thin"),
    ("", None, ""),
]  # fmt: skip


@pytest.mark.parametrize(("text", "reasoning", "content"), CASES)
def test_whole_answers(text, reasoning, content):
    got_reasoning, got_content, _ = AnswerParser(ThinkSplitter, None).feed(text, last=True)
    assert (got_reasoning or None, got_content) == (reasoning, content)


@pytest.mark.parametrize(("text", "reasoning", "content"), CASES)
def test_every_way_of_cutting_the_stream_in_three(text, reasoning, content):
    for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        splitter, got = ThinkSplitter(), ["", ""]
        for piece in (text[:i], text[i:j], text[j:]):
            r, c = splitter.feed(piece)
            assert "<think" not in r + c or "<think>" in content  # no tag leaks as text
            got[0], got[1] = got[0] + r, got[1] + c
        r, c = splitter.finish()
        assert ((got[0] + r) or None, got[1] + c) == (reasoning, content), (i, j)


@pytest.fixture(scope="module")
def reasoning_server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("reasoning-log") / "server.log"
    running = start_server(tiny_model, log, "--max-model-len", "512",
                           "--reasoning-parser", "qwen3")  # fmt: skip
    yield running
    stop_server(running)


def test_server_with_a_reasoning_parser_answers_in_both_shapes(reasoning_server, server):
    """The tiny model's random text holds no think block: everything stays content, streamed
    and not, as the server without a parser answers."""
    messages = [{"role": "user", "content": "Think about blocks."}]
    answers = []
    for running in (reasoning_server, server):
        client = openai.OpenAI(base_url=running.base_url, api_key="none")
        create = client.chat.completions.create
        full = create(model=running.model, messages=messages, max_tokens=16, temperature=0)
        stream = create(model=running.model, messages=messages, max_tokens=16, temperature=0,
                        stream=True)  # fmt: skip
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == full.choices[0].message.content
        answers.append(full.choices[0].message.content)
    assert answers[0] == answers[1]
