"""vLLM's tests/entrypoints/openai/chat_completion/test_chat_logit_bias_validation.py."""

from __future__ import annotations

import openai
import pytest

MESSAGES = [{"role": "user", "content": "Testing logit bias"}]


def refused(client, server, logit_bias) -> str:
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=server.model, messages=MESSAGES, max_tokens=5, logit_bias=logit_bias
        )
    assert error.value.status_code == 400
    return str(error.value)


def test_chat_logit_bias_valid(client, server, vocab_size):
    """test_chat_logit_bias_valid: the vocabulary's last id is accepted."""
    reply = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=5, logit_bias={str(vocab_size - 1): 1.0}
    )
    assert reply.choices[0].message.content is not None


def test_chat_logit_bias_invalid(client, server, vocab_size):
    """test_chat_logit_bias_invalid: an id past the vocabulary is a 400 naming it and the size."""
    message = refused(client, server, {str(vocab_size + 1): 1.0})
    assert str(vocab_size + 1) in message and str(vocab_size) in message


def test_chat_logit_bias_non_integer_key(client, server):
    """test_chat_logit_bias_non_integer_key: a 400 naming the key and logit_bias."""
    message = refused(client, server, {"not_a_token_id": 50})
    assert "not_a_token_id" in message and "logit_bias" in message


def test_chat_logit_bias_non_numeric_value(client, server):
    """test_chat_logit_bias_non_numeric_value: a 400 naming logit_bias."""
    assert "logit_bias" in refused(client, server, {"1": "not_a_number"})


def test_chat_logit_bias_multiple_non_integer_keys(client, server):
    """test_chat_logit_bias_multiple_non_integer_keys: every bad key is named."""
    message = refused(client, server, {"bad1": 50.0, "bad2": 20.0})
    assert "bad1" in message and "bad2" in message
