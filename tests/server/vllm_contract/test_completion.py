"""vLLM's tests/entrypoints/openai/completion/test_completion.py, behaviour for behaviour.

The tiny checkpoint has random weights, so where vLLM checks text against a known model these
check what a random model can answer: shapes, usage counts, finish reasons, equality between
streamed and whole answers, seeds, and refusals as 400s.
"""

from __future__ import annotations

import openai
import pytest

from tests.server.helpers import PROMPT, tokenize

TOKEN_PROMPT = [0, 0, 0, 0, 0]


def test_single_completion(client, server):
    """test_single_completion: id, one choice, finish_reason length, exact usage with
    prompt_tokens_details.cached_tokens; a token-id prompt answers and has no prompt_logprobs."""
    completion = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=5, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    prompt_tokens = len(tokenize(server, prompt=PROMPT))
    assert completion.id
    assert len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.text
    assert choice.finish_reason == "length"
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, 5)
    assert usage.total_tokens == prompt_tokens + 5
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 0  # 7 tokens never fill a block of 8

    completion = client.completions.create(
        model=server.model, prompt=TOKEN_PROMPT, max_tokens=5, temperature=0.0
    )
    assert completion.usage.prompt_tokens == len(TOKEN_PROMPT)
    assert completion.choices[0].model_extra["prompt_logprobs"] is None


@pytest.mark.parametrize("side", ["right", "left"])
def test_completion_truncation_side_controls_prompt_truncation(client, server, side):
    """test_completion_truncation_side_controls_prompt_truncation: truncate_prompt_tokens keeps
    the first (right) or last (left) tokens, as return_token_ids shows."""
    prompt = list(range(8))
    completion = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=1, temperature=0.0,
        extra_body={"return_token_ids": True, "truncate_prompt_tokens": 4,
                    "truncation_side": side},
    )  # fmt: skip
    kept = prompt[:4] if side == "right" else prompt[-4:]
    assert completion.choices[0].model_extra["prompt_token_ids"] == kept
    assert completion.usage.prompt_tokens == 4


def test_no_logprobs(client, server):
    """test_no_logprobs: logprobs=None gives choice.logprobs None."""
    completion = client.completions.create(
        model=server.model, prompt=TOKEN_PROMPT, max_tokens=5, temperature=0.0, logprobs=None
    )
    assert completion.choices[0].logprobs is None


@pytest.mark.parametrize("logprobs", [0, 5])
def test_zero_and_some_logprobs(client, server, logprobs):
    """test_zero_logprobs, test_some_logprobs: every position has between max(k, 1) and k + 1
    alternatives (the sampled token is always among them)."""
    completion = client.completions.create(
        model=server.model, prompt=TOKEN_PROMPT, max_tokens=5, temperature=0.0,
        logprobs=logprobs, extra_body={"ignore_eos": True},
    )  # fmt: skip
    result = completion.choices[0].logprobs
    assert len(result.tokens) == len(result.token_logprobs) == len(result.top_logprobs) == 5
    columns = (result.tokens, result.token_logprobs, result.top_logprobs)
    for token, logprob, top in zip(*columns, strict=True):
        assert max(logprobs, 1) <= len(top) <= logprobs + 1
        assert top[token] == logprob <= 0.0


def test_too_many_completion_logprobs(client, server):
    """test_too_many_completion_logprobs: logprobs above 20 is a 400, streamed or not, and the
    server still answers afterwards."""
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model=server.model, prompt=TOKEN_PROMPT, max_tokens=5, logprobs=21
        )
    with pytest.raises(openai.BadRequestError):
        for _ in client.completions.create(
            model=server.model, prompt=TOKEN_PROMPT, max_tokens=5, logprobs=30, stream=True
        ):
            pass
    completion = client.completions.create(
        model=server.model, prompt=TOKEN_PROMPT, max_tokens=5, temperature=0.0
    )
    assert completion.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("prompt_logprobs", [-1, 0, 1, None])
def test_prompt_logprobs_completion(client, server, prompt_logprobs):
    """test_prompt_logprobs_completion: two prompts; each choice carries its prompt's
    prompt_logprobs (None for the first position), a negative value is a 400, absent is null."""
    prompts = ["A robot may not injure another robot", "My name is"]
    extra = {} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs}
    create = client.completions.create
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(openai.BadRequestError):
            create(model=server.model, prompt=prompts, max_tokens=2, extra_body=extra)
        return
    completion = create(model=server.model, prompt=prompts, max_tokens=2, extra_body=extra)
    assert len(completion.choices) == 2
    for choice in completion.choices:
        result = choice.model_extra["prompt_logprobs"]
        if prompt_logprobs is None:
            assert result is None
            continue
        prompt_ids = tokenize(server, prompt=prompts[choice.index])
        assert len(result) == len(prompt_ids) and result[0] is None
        for position, token in zip(result[1:], prompt_ids[1:], strict=True):
            assert str(token) in position  # the prompt's own token, plus the top k
            assert max(prompt_logprobs, 1) <= len(position) <= prompt_logprobs + 1


def test_completion_streaming(client, server):
    """test_completion_streaming: the streamed pieces join to the whole answer; exactly one
    chunk, the last, carries a finish_reason."""
    kwargs = dict(model=server.model, prompt="What is an LLM?", max_tokens=5, temperature=0.0)
    single = client.completions.create(**kwargs).choices[0]
    chunks, reasons = [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        chunks.append(chunk.choices[0].text)
        reasons.append(chunk.choices[0].finish_reason)
    assert [r for r in reasons if r is not None] == [single.finish_reason]
    assert reasons[-1] == single.finish_reason
    assert "".join(chunks) == single.text


def test_parallel_no_streaming(client, server):
    """test_parallel_no_streaming: n=3 at temperature 1 with a seed gives three indexed choices
    with a finish_reason each, all different; logprobs=0 lists one entry per token."""
    completion = client.completions.create(
        model=server.model, prompt="What is an LLM?", max_tokens=12, n=3, temperature=1.0,
        logprobs=0, seed=42,
    )  # fmt: skip
    assert [choice.index for choice in completion.choices] == [0, 1, 2]
    for choice in completion.choices:
        assert choice.finish_reason in ("stop", "length")
        assert 1 <= len(choice.logprobs.tokens) <= 12
    assert len({choice.text for choice in completion.choices}) == 3
    total = sum(len(choice.logprobs.tokens) for choice in completion.choices)
    assert completion.usage.completion_tokens == total


def test_parallel_streaming(client, server):
    """test_parallel_streaming: the n=3 stream interleaves choices by index, one finish_reason
    each, and equals the same seeded request answered whole."""
    kwargs = dict(model=server.model, prompt="What is an LLM?", max_tokens=12, n=3,
                  temperature=1.0, seed=42)  # fmt: skip
    texts, finished = ["", "", ""], [0, 0, 0]
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finished[choice.index] += choice.finish_reason is not None
    assert finished == [1, 1, 1]
    assert len(set(texts)) == 3
    whole = client.completions.create(**kwargs)
    assert texts == [choice.text for choice in whole.choices]


def test_completion_stream_options(client, server):
    """test_completion_stream_options: usage only where asked (the final, choice-less chunk
    with include_usage; every chunk with continuous_usage_stats too); stream_options without
    stream is a 400."""
    kwargs = dict(model=server.model, prompt="What is the capital of France?", max_tokens=5,
                  temperature=0.0, extra_body={"ignore_eos": True})  # fmt: skip
    for options in ({"include_usage": False, "continuous_usage_stats": False},
                    {"include_usage": False, "continuous_usage_stats": True}, {}):  # fmt: skip
        for chunk in client.completions.create(stream=True, stream_options=options, **kwargs):
            assert chunk.usage is None

    chunks = list(client.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs))  # fmt: skip
    *answer, final = chunks
    assert all(chunk.usage is None for chunk in answer)
    assert answer[-1].choices[0].finish_reason == "length"
    assert final.choices == []
    assert final.usage.completion_tokens == 5 and final.usage.prompt_tokens > 0
    assert final.usage.total_tokens == final.usage.prompt_tokens + 5

    chunks = list(client.completions.create(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        **kwargs))  # fmt: skip
    assert all(chunk.usage is not None for chunk in chunks)
    for chunk in chunks:
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert [c.usage.completion_tokens for c in chunks] == sorted(c.usage.completion_tokens
                                                                  for c in chunks)  # fmt: skip

    refused = [{"include_usage": None}, {"include_usage": True},
               {"continuous_usage_stats": None}, {"continuous_usage_stats": True}]  # fmt: skip
    for options in refused:
        with pytest.raises(openai.BadRequestError):
            client.completions.create(stream=False, stream_options=options, **kwargs)


@pytest.mark.parametrize("prompt", ["Hello, my name is", TOKEN_PROMPT], ids=["text", "ids"])
def test_batch_completions(client, server, prompt):
    """test_batch_completions: a list of two equal prompts answers twice the same, whole and
    streamed (one choice per chunk, by index); `use_beam_search`, which we do not implement, is
    refused with a 400 naming it (vLLM's n=2 beam-search case)."""
    prompts = [prompt, prompt]
    kwargs = dict(model=server.model, prompt=prompts, max_tokens=5, temperature=0.0)
    batch = client.completions.create(**kwargs)
    assert [choice.index for choice in batch.choices] == [0, 1]
    assert batch.choices[0].text == batch.choices[1].text

    texts = ["", ""]
    for chunk in client.completions.create(stream=True, **kwargs):
        assert len(chunk.choices) == 1
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [batch.choices[0].text] * 2

    batch = client.completions.create(**{**kwargs, "n": 2, "temperature": 1.0, "seed": 3})
    assert [choice.index for choice in batch.choices] == [0, 1, 2, 3]
    with pytest.raises(openai.BadRequestError, match="use_beam_search"):
        client.completions.create(n=2, extra_body={"use_beam_search": True}, **kwargs)


@pytest.mark.parametrize("logprobs", [1, 0])
@pytest.mark.parametrize("prompt", ["Hello, my name is", TOKEN_PROMPT], ids=["text", "ids"])
def test_echo_logprob_completion(client, server, hf_tokenizer, logprobs, prompt):
    """test_echo_logprob_completion: echo puts the prompt's text first; the logprobs cover the
    prompt and the answer, the first position scored None, others 1..k+1 alternatives."""
    completion = client.completions.create(
        model=server.model, prompt=prompt, max_tokens=5, temperature=0.0, echo=True,
        logprobs=logprobs, extra_body={"ignore_eos": True},
    )  # fmt: skip
    prompt_text = hf_tokenizer.decode(prompt) if isinstance(prompt, list) else prompt
    choice = completion.choices[0]
    assert choice.text.startswith(prompt_text)
    result = choice.logprobs
    n_prompt = completion.usage.prompt_tokens
    assert len(result.tokens) == len(result.token_logprobs) == n_prompt + 5
    assert len(result.text_offset) == n_prompt + 5
    assert result.token_logprobs[0] is None and result.top_logprobs[0] is None
    for top in result.top_logprobs[1:]:
        assert max(logprobs, 1) <= len(top) <= logprobs + 1
    assert "".join(result.tokens) == choice.text


@pytest.mark.parametrize(
    "structured",
    [
        {"json": {"type": "object", "properties": {"foo": "bar"}}},
        {"regex": "[.*"},
        {"grammar": 'root ::= select_statementinvalidsyntax\nselect_statement ::= "SELECT "'},
    ],
    ids=["json", "regex", "grammar"],
)
def test_invalid_json_schema_regex_grammar(client, server, structured):
    """test_invalid_json_schema, test_invalid_regex, test_invalid_grammar: a constraint that
    does not compile is a 400, not an answer."""
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model=server.model, prompt="Generate", max_tokens=5,
            extra_body={"structured_outputs": structured},
        )  # fmt: skip
