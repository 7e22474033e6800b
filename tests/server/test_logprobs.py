"""Logprobs over HTTP in OpenAI's two shapes, whole and streamed, and consistent with the
tokens and text they describe."""

from __future__ import annotations

import math

import openai
import pytest

from pegainfer.core.engine.messages import TokenLogprob
from pegainfer.server.logprobs import LogprobsFormatter


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none")


def test_completions_shape(client, server):
    reply = client.completions.create(model=server.model, prompt="Hello", max_tokens=8,
                                      temperature=0, logprobs=3, seed=1)  # fmt: skip
    choice = reply.choices[0]
    lp = choice.logprobs
    n = reply.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert all(len(top) <= 3 and top for top in lp.top_logprobs)
    # Greedy: each token is its position's most likely, so it heads its own top list.
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and math.isclose(max(top.values()), logprob, abs_tol=1e-5)
        assert top.get(token) is not None
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_completions_zero_means_the_sampled_token_only(client, server):
    reply = client.completions.create(model=server.model, prompt="Hi", max_tokens=4, logprobs=0)
    lp = reply.choices[0].logprobs
    assert len(lp.token_logprobs) == 4
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top == {token: logprob}


def test_completions_top_logprobs_include_the_sampled_token(client, server):
    """OpenAI: up to logprobs + 1 entries, the chosen token always among them."""
    reply = client.completions.create(model=server.model, prompt="Hi", max_tokens=16,
                                      temperature=1.5, seed=3, logprobs=1)  # fmt: skip
    lp = reply.choices[0].logprobs
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == logprob and 1 <= len(top) <= 2
        assert max(top.values()) >= logprob
    assert any(len(top) == 2 for top in lp.top_logprobs)  # some sampled token was not the top


def test_completions_top_logprobs_keep_tokens_that_decode_alike():
    """Byte pieces of one character each decode to U+FFFD: no entry may be lost to that."""

    class BytePieces:
        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            return "\ufffd" if ids[0] >= 100 else f"t{ids[0]}"

    formatter = LogprobsFormatter(BytePieces())  # type: ignore[arg-type]
    entry = TokenLogprob(101, -1.0, 2, [(102, -0.5), (101, -1.0), (7, -2.0), (103, -3.0)])
    assert formatter.completion([entry])[0].top_logprobs == [
        {"\ufffd": -1.0, "token_id:102": -0.5, "t7": -2.0, "token_id:103": -3.0}
    ]


def test_chat_shape_matches_its_stream(client, server):
    kwargs = dict(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                  max_tokens=10, temperature=0, logprobs=True, top_logprobs=4)  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert len(whole) == 10
    for entry in whole:
        assert len(entry.top_logprobs) == 4 and entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob == max(t.logprob for t in entry.top_logprobs)
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-5)
    streamed = [entry for chunk in client.chat.completions.create(stream=True, **kwargs)
                if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]  # fmt: skip
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in whole
    ]


def test_chat_without_logprobs_has_none(client, server):
    messages = [{"role": "user", "content": "Hi"}]
    reply = client.chat.completions.create(model=server.model, max_tokens=3, messages=messages)
    assert reply.choices[0].logprobs is None


@pytest.mark.parametrize("prompt", ["The cat sat", [11, 22, 33, 44]])
def test_echo_scores_the_prompt(client, server, prompt):
    """The echoed prompt leads the text; its tokens lead the logprobs (the first unscored),
    the same streamed."""
    kwargs = dict(model=server.model, prompt=prompt, max_tokens=5, temperature=0, echo=True,
                  logprobs=2)  # fmt: skip
    reply = client.completions.create(**kwargs)
    choice, usage = reply.choices[0], reply.usage
    lp = choice.logprobs
    assert len(lp.tokens) == usage.prompt_tokens + usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
    if isinstance(prompt, str):
        assert choice.text.startswith(prompt)
    pieces = list(client.completions.create(stream=True, **kwargs))
    streamed = [v for p in pieces for v in p.choices[0].logprobs.token_logprobs]
    assert "".join(p.choices[0].text for p in pieces) == choice.text
    assert [None if v is None else round(v, 4) for v in streamed] == [
        None if v is None else round(v, 4) for v in lp.token_logprobs
    ]


def test_echo_without_logprobs(client, server):
    reply = client.completions.create(model=server.model, prompt="Once", max_tokens=3, echo=True)
    assert reply.choices[0].text.startswith("Once") and reply.choices[0].logprobs is None
