"""vLLM's tests/entrypoints/openai/test_return_tokens_as_ids.py, the request-field half (the
`--return-tokens-as-token-ids` server flag is not ported: README.md in this folder)."""

from __future__ import annotations


def ids_of(tokens: list[str]) -> list[int]:
    assert all(token.startswith("token_id:") for token in tokens), tokens
    return [int(token.removeprefix("token_id:")) for token in tokens]


def test_completion_return_tokens_as_token_ids_completion(client, server, hf_tokenizer):
    """test_completion_return_tokens_as_token_ids_completion: with echo and logprobs, every
    token (a multi-byte emoji's pieces too) is `token_id:N`, the top_logprobs keys spell the
    same tokens, and the ids decode to the text."""
    completion = client.completions.create(
        model=server.model, prompt="Say 'Hello, world! 🎉'", echo=True, temperature=0,
        max_tokens=10, logprobs=1, extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    choice = completion.choices[0]
    tokens = choice.logprobs.tokens
    assert tokens[1:] == [next(iter(top)) for top in choice.logprobs.top_logprobs[1:]]
    assert hf_tokenizer.decode(ids_of(tokens), skip_special_tokens=True) == choice.text


def test_chat_return_tokens_as_token_ids_completion(client, server, hf_tokenizer):
    """test_chat_return_tokens_as_token_ids_completion: every logprobs entry's token is
    `token_id:N`, and the ids decode to the message's content."""
    reply = client.chat.completions.create(
        model=server.model, temperature=0, max_tokens=8, logprobs=True,
        messages=[{"role": "system", "content": "You like to respond in only emojis, like 🎉"},
                  {"role": "user", "content": "Please write some emojis: 🐱🐶🎉"}],
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    ids = ids_of([entry.token for entry in reply.choices[0].logprobs.content])
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == reply.choices[0].message.content
