"""vLLM's tests/entrypoints/openai/chat_completion/test_chat_stop_token_ids_validation.py."""

from __future__ import annotations

import openai
import pytest

MESSAGES = [{"role": "user", "content": "Testing stop token ids"}]


def test_chat_stop_token_ids_valid(client, server, vocab_size):
    """test_chat_stop_token_ids_valid: the vocabulary's last id is accepted."""
    reply = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=5,
        extra_body={"stop_token_ids": [vocab_size - 1]},
    )  # fmt: skip
    assert reply.choices[0].message.content is not None


@pytest.mark.parametrize("past_vocab", [True, False], ids=["out_of_vocab", "negative"])
def test_chat_stop_token_ids_out_of_vocab_or_negative(client, server, vocab_size, past_vocab):
    """test_chat_stop_token_ids_out_of_vocab, test_chat_stop_token_ids_negative: a 400; past the
    vocabulary, naming the id and the vocabulary's size."""
    token = vocab_size + 1 if past_vocab else -1
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=server.model, messages=MESSAGES, max_tokens=5,
            extra_body={"stop_token_ids": [token]},
        )  # fmt: skip
    assert error.value.status_code == 400
    if past_vocab:
        assert str(token) in str(error.value) and str(vocab_size) in str(error.value)
