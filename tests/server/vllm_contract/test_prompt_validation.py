"""vLLM's tests/entrypoints/openai/completion/test_prompt_validation.py and
test_empty_prompt_list.py, for text and token prompts (prompt_embeds are not accepted:
README.md in this folder)."""

from __future__ import annotations

import openai
import pytest


@pytest.mark.parametrize("prompt", ["", [], [[]]], ids=["empty-text", "empty-list", "empty-ids"])
def test_empty_prompt(client, server, prompt):
    """test_empty_prompt, test_empty_prompt_list_rejected: an empty prompt is a 400."""
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server.model, prompt=prompt, max_tokens=5)


def test_nonempty_prompt_list_ok(client, server):
    """test_nonempty_prompt_list_ok: a list of one prompt answers one choice."""
    completion = client.completions.create(model=server.model, prompt=["hello"], max_tokens=2)
    assert len(completion.choices) == 1


def test_out_of_vocab_token_ids(client, server):
    """test_out_of_vocab_token_ids: a prompt token past the vocabulary is a 400 saying so."""
    with pytest.raises(openai.BadRequestError, match="out of vocabulary"):
        client.completions.create(model=server.model, prompt=[999999], max_tokens=5)


def test_prompt_embeds_refused(client, server):
    """test_empty_prompt's prompt_embeds: refused with a 400 naming the field."""
    with pytest.raises(openai.BadRequestError, match="prompt_embeds"):
        client.completions.create(
            model=server.model, prompt="hi", max_tokens=5, extra_body={"prompt_embeds": "AAAA"}
        )
