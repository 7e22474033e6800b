"""vLLM's tests/entrypoints/openai/completion/test_completion_text_offset.py, end to end: a
stream's logprobs text_offset equals the whole answer's, with a stop string that holds text
back."""

from __future__ import annotations


def test_stream_text_offset_matches_non_stream_with_stop_holdback(client, server):
    """test_stream_text_offset_matches_non_stream_with_stop_holdback: the offsets of the
    streamed tokens, in order, are the whole answer's; each is where its token starts in the
    text."""
    kwargs = dict(model=server.model, prompt="Hi", max_tokens=8, logprobs=0, stop=["\n\n"],
                  temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.completions.create(**kwargs).choices[0]
    offsets, tokens = [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        offsets += chunk.choices[0].logprobs.text_offset
        tokens += chunk.choices[0].logprobs.tokens
    assert offsets == whole.logprobs.text_offset and tokens == whole.logprobs.tokens
    starts = [sum(len(token) for token in tokens[:i]) for i in range(len(tokens))]
    assert offsets == starts
