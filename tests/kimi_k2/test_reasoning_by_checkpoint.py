"""The Kimi-K2 line serves each checkpoint with the reasoning parser its answers need: a tiny
K2-Thinking (its chat template writes thinking) splits the answer as thinking from the first
token, a tiny K2-Instruct (no thinking in its template) answers in content, with no flag."""

from __future__ import annotations

import openai
import pytest

from pegainfer.models.kimi_k2.tiny import write_tiny_kimi
from tests.server.conftest import start_server, stop_server


@pytest.mark.parametrize("thinking", [True, False], ids=["K2-Thinking", "K2-Instruct"])
def test_the_answer_is_split_as_the_checkpoint_thinks(tmp_path, thinking):
    write_tiny_kimi(tmp_path / "model", thinking=thinking)
    server = start_server(tmp_path / "model", tmp_path / "server.log", "--max-model-len", "256")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
        reply = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
            temperature=0,
        )  # fmt: skip
    finally:
        stop_server(server)
    message, details = reply.choices[0].message, reply.usage.completion_tokens_details
    reasoning = getattr(message, "reasoning_content", None)
    if thinking:  # an answer that never closes its thinking is all reasoning
        assert reasoning and not message.content and details.reasoning_tokens > 0
    else:
        assert message.content and reasoning is None
        assert details is None or details.reasoning_tokens is None
