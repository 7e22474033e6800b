"""vLLM's tests/entrypoints/openai/chat_completion/test_cache_accounting.py, in the field we
claim: a repeated conversation's prompt is read from the prefix cache, and usage says how much
in `prompt_tokens_details.cached_tokens` (vLLM's newer `cache_read_input_tokens` is not served:
README.md in this folder)."""

from __future__ import annotations

import uuid

import pytest


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_cache_accounting(client, server, stream):
    """test_cache_accounting_non_streaming, test_cache_accounting_streaming: the first request
    of a conversation reads nothing from the cache; the same conversation again reads its
    whole blocks (the final usage chunk when streamed)."""
    question = "What is the capital of Germany?" if stream else "What is the capital of France?"
    fresh = uuid.uuid4().hex  # within the first block: no earlier request shares it
    messages = [{"role": "system", "content": f"{fresh} You are a helpful assistant."},
                {"role": "user", "content": question}]  # fmt: skip
    kwargs = dict(model=server.model, messages=messages, max_completion_tokens=5, temperature=0)
    first = client.chat.completions.create(**kwargs).usage
    assert first.prompt_tokens_details.cached_tokens == 0
    if not stream:
        second = client.chat.completions.create(**kwargs).usage
    else:
        chunks = list(client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs))  # fmt: skip
        second = chunks[-1].usage
    cached = second.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 8 == 0  # whole blocks of the server's --block-size 8
    assert cached < second.prompt_tokens == first.prompt_tokens
