"""The server driven by the official `openai` SDK, sync and async, streaming and not."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.server.helpers import MESSAGES, PROMPT, tokenize

GREEDY_N = 8


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def async_client(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def check_usage(usage: Any, prompt_tokens: int, completion_tokens: int) -> None:
    assert usage.prompt_tokens == prompt_tokens
    assert usage.completion_tokens == completion_tokens
    assert usage.total_tokens == prompt_tokens + completion_tokens
    assert usage.prompt_tokens_details is not None
    assert isinstance(usage.prompt_tokens_details.cached_tokens, int)


# ------------------------------------------------------------------------ response shapes


def test_models_list(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [server.model]
    assert models[0].object == "model"
    assert models[0].model_extra["max_model_len"] == 512


def test_completion_shape_and_exact_usage(client, server):
    before = int(time.time())
    response = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert response.id.startswith("cmpl-")
    assert response.object == "text_completion"
    assert response.model == server.model
    assert before - 1 <= response.created <= time.time() + 1
    assert len(response.choices) == 1
    choice = response.choices[0]
    assert choice.index == 0
    assert isinstance(choice.text, str) and choice.text
    assert choice.finish_reason == "length"
    check_usage(response.usage, len(tokenize(server, prompt=PROMPT)), 5)
    assert response.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_shape_and_exact_usage(client, server):
    response = client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert response.id.startswith("chatcmpl-")
    assert response.object == "chat.completion"
    assert response.model == server.model
    assert len(response.choices) == 1
    choice = response.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"
    check_usage(response.usage, len(tokenize(server, messages=MESSAGES)), 6)


def test_omitted_model_uses_the_served_name(client, server):
    # The SDK insists on `model`; an empty extra_body override drops nothing, so go raw.
    response = client.post(
        "/completions",
        cast_to=openai.types.Completion,
        body={"prompt": PROMPT, "max_tokens": 1},
    )
    assert response.model == server.model
    assert response.usage.completion_tokens == 1


# ------------------------------------------------------- streaming matches non-streaming


async def _run(server, endpoint: str, use_async: bool, **kwargs: Any):
    """(non-streamed text, finish_reason, usage, streamed deltas, streamed chunks)."""
    sync = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    aclient = async_client(server)
    create = {
        ("completions", False): sync.completions.create,
        ("chat", False): sync.chat.completions.create,
        ("completions", True): aclient.completions.create,
        ("chat", True): aclient.chat.completions.create,
    }[(endpoint, use_async)]

    async def call(**extra: Any) -> Any:
        result = create(model=server.model, **kwargs, **extra)
        return await result if use_async else result

    whole = await call()
    stream = await call(stream=True, stream_options={"include_usage": True})
    chunks = []
    if use_async:
        async for chunk in stream:
            chunks.append(chunk)
    else:
        chunks.extend(stream)
    await aclient.close()
    choice = whole.choices[0]
    text = choice.text if endpoint == "completions" else choice.message.content
    deltas = []
    for chunk in chunks[:-1]:
        assert len(chunk.choices) == 1
        c = chunk.choices[0]
        deltas.append(c.text if endpoint == "completions" else (c.delta.content or ""))
    return text, choice.finish_reason, whole.usage, deltas, chunks


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_greedy_stream_equals_non_stream(server, endpoint, use_async):
    if endpoint == "completions":
        kwargs: dict[str, Any] = {"prompt": PROMPT}
        prompt_tokens = len(tokenize(server, prompt=PROMPT))
        id_prefix, chunk_object = "cmpl-", "text_completion"
    else:
        kwargs = {"messages": MESSAGES}
        prompt_tokens = len(tokenize(server, messages=MESSAGES))
        id_prefix, chunk_object = "chatcmpl-", "chat.completion.chunk"
    kwargs |= {"max_tokens": GREEDY_N, "temperature": 0, "extra_body": {"ignore_eos": True}}
    text, finish, usage, deltas, chunks = asyncio.run(_run(server, endpoint, use_async, **kwargs))

    assert finish == "length"
    check_usage(usage, prompt_tokens, GREEDY_N)
    assert "".join(deltas) == text
    assert text, "the tiny model should produce visible text for this prompt"
    ids = {chunk.id for chunk in chunks}
    assert len(ids) == 1 and ids.pop().startswith(id_prefix)
    assert {chunk.object for chunk in chunks} == {chunk_object}
    reasons = [chunk.choices[0].finish_reason for chunk in chunks[:-1]]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    last = chunks[-1]
    assert last.choices == []
    check_usage(last.usage, prompt_tokens, GREEDY_N)
    if endpoint == "chat":
        assert chunks[0].choices[0].delta.role == "assistant"
        assert all(chunk.choices[0].delta.role is None for chunk in chunks[1:-1])


def test_greedy_is_repeatable(client, server):
    texts = {
        client.completions.create(
            model=server.model, prompt=PROMPT, max_tokens=GREEDY_N, temperature=0
        )
        .choices[0]
        .text
        for _ in range(3)
    }
    assert len(texts) == 1


def test_seeded_sampling_is_repeatable(client, server):
    def sample() -> str:
        return (
            client.completions.create(
                model=server.model, prompt=PROMPT, max_tokens=GREEDY_N, temperature=1.0, seed=7
            )
            .choices[0]
            .text
        )

    assert sample() == sample()


# --------------------------------------------------------------------------- stopping


def test_stop_string_completions(client, server):
    common: dict[str, Any] = {"model": server.model, "prompt": PROMPT, "temperature": 0}
    full = client.completions.create(max_tokens=12, **common).choices[0].text
    stop = full[-3:]
    assert len(stop) == 3
    expected = full[: full.index(stop)]

    response = client.completions.create(max_tokens=12, stop=[stop], **common)
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == expected
    assert choice.model_extra["stop_reason"] == stop
    assert response.usage.completion_tokens < 12

    stream = client.completions.create(max_tokens=12, stop=stop, stream=True, **common)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_string_chat(client, server):
    common: dict[str, Any] = {"model": server.model, "messages": MESSAGES, "temperature": 0}
    full = client.chat.completions.create(max_tokens=12, **common).choices[0].message.content
    stop = full[len(full) // 3 :][:3]  # from early in the text, so generation stops early
    assert stop.strip(), f"pick a stop string with visible characters from {full!r}"
    expected = full[: full.index(stop)]
    response = client.chat.completions.create(max_tokens=12, stop=stop, **common)
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].message.content == expected
    assert response.usage.completion_tokens < 12


def test_stop_token_ids(client, server):
    # A prompt whose first greedy token survives a text round trip as one token.
    for prompt in (PROMPT, "Hello", "The quick brown fox", "1 2 3 4", "abc"):
        common: dict[str, Any] = {"model": server.model, "prompt": prompt, "temperature": 0}
        first = client.completions.create(max_tokens=1, **common).choices[0].text
        ids = tokenize(server, prompt=first)
        if len(ids) == 1:
            break
    else:
        pytest.fail("no prompt's first token round-trips as a single token")
    (first_id,) = ids
    response = client.completions.create(
        max_tokens=12, extra_body={"stop_token_ids": [first_id]}, **common
    )
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].model_extra["stop_reason"] == first_id
    assert response.usage.completion_tokens == 1


def test_max_completion_tokens_wins_over_max_tokens(client, server):
    common: dict[str, Any] = {
        "model": server.model,
        "messages": MESSAGES,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    both = client.chat.completions.create(max_tokens=7, max_completion_tokens=3, **common)
    assert both.usage.completion_tokens == 3
    assert both.choices[0].finish_reason == "length"
    only_max_tokens = client.chat.completions.create(max_tokens=7, **common)
    assert only_max_tokens.usage.completion_tokens == 7
    only_new = client.chat.completions.create(max_completion_tokens=4, **common)
    assert only_new.usage.completion_tokens == 4


# ---------------------------------------------------------------------- prompt shapes

PROMPTS = [PROMPT, "Call me Ishmael.", "def fibonacci(n):"]


def single_text(client, server, prompt: Any, n: int = GREEDY_N) -> str:
    return (
        client.completions.create(model=server.model, prompt=prompt, max_tokens=n, temperature=0)
        .choices[0]
        .text
    )


def test_several_prompts_one_choice_each(client, server):
    response = client.completions.create(
        model=server.model,
        prompt=PROMPTS,
        max_tokens=GREEDY_N,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert [c.text for c in response.choices] == [single_text(client, server, p) for p in PROMPTS]
    prompt_tokens = sum(len(tokenize(server, prompt=p)) for p in PROMPTS)
    check_usage(response.usage, prompt_tokens, GREEDY_N * len(PROMPTS))


def test_several_prompts_streamed(client, server):
    stream = client.completions.create(
        model=server.model,
        prompt=PROMPTS,
        max_tokens=GREEDY_N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    texts = ["", "", ""]
    finishes: list[list[str]] = [[], [], []]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finishes[choice.index].append(choice.finish_reason)
    assert finishes == [["length"]] * 3
    assert texts == [single_text(client, server, p) for p in PROMPTS]
    assert chunks[-1].choices == []
    prompt_tokens = sum(len(tokenize(server, prompt=p)) for p in PROMPTS)
    check_usage(chunks[-1].usage, prompt_tokens, GREEDY_N * len(PROMPTS))


def test_token_id_prompts(client, server):
    ids = tokenize(server, prompt=PROMPT)
    response = client.completions.create(
        model=server.model, prompt=ids, max_tokens=GREEDY_N, temperature=0
    )
    assert response.choices[0].text == single_text(client, server, PROMPT)
    assert response.usage.prompt_tokens == len(ids)

    other = tokenize(server, prompt=PROMPTS[1])
    batch = client.completions.create(
        model=server.model,
        prompt=[ids, other],
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in batch.choices] == [0, 1]
    check_usage(batch.usage, len(ids) + len(other), 6)


# ----------------------------------------------------------------------- prefix caching


def test_cached_tokens_reported_for_a_repeated_long_prompt(client, server):
    # Unique, so no earlier test has cached it; well over two blocks of 8 tokens.
    prompt = f"{uuid.uuid4().hex} It was the best of times, it was the worst of times."
    prompt_tokens = len(tokenize(server, prompt=prompt))
    assert prompt_tokens > 2 * 8

    def cached(**extra: Any) -> int:
        response = client.completions.create(
            model=server.model, prompt=prompt, max_tokens=2, **extra
        )
        assert response.usage.prompt_tokens == prompt_tokens
        return response.usage.prompt_tokens_details.cached_tokens

    assert cached() == 0
    hit = cached()
    assert hit >= 2 * 8 and hit % 8 == 0 and hit < prompt_tokens
    # A cache salt keeps tenants apart: the same prompt under a new salt is not a hit.
    assert cached(extra_body={"cache_salt": "tenant-a"}) == 0
    assert cached(extra_body={"cache_salt": "tenant-a"}) == hit


def test_cached_tokens_for_a_repeated_chat(client, server):
    messages = [
        {"role": "system", "content": f"{uuid.uuid4().hex} Answer in one word, please."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    assert len(tokenize(server, messages=messages)) > 2 * 8

    def cached() -> int:
        response = client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=2
        )
        return response.usage.prompt_tokens_details.cached_tokens

    assert cached() == 0
    assert cached() > 0


# --------------------------------------------------------------------------- SDK errors


def test_sdk_raises_typed_errors(client, server):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=server.model, prompt=PROMPT, temperature=-1)
    assert bad.value.status_code == 400
    assert bad.value.param == "temperature"
    assert bad.value.type == "invalid_request_error"

    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert missing.value.status_code == 404
    assert missing.value.code == "model_not_found"


def test_async_sdk_errors_leave_the_server_serving(server):
    async def go() -> None:
        aclient = async_client(server)
        with pytest.raises(openai.BadRequestError) as bad:
            await aclient.chat.completions.create(
                model=server.model, messages=MESSAGES, n=0, stream=True
            )
        assert bad.value.param == "n"
        ok = await aclient.chat.completions.create(
            model=server.model, messages=MESSAGES, max_tokens=2
        )
        assert ok.usage.completion_tokens <= 2
        await aclient.close()

    asyncio.run(go())


def test_n_choices_with_distinct_seeds(server):
    """n = 3: three choices, each reproducible with the request's seed, the prompt counted
    once; streamed choices carry their index."""
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    ask = dict(model=server.model, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=11)
    first = client.chat.completions.create(n=3, **ask)
    again = client.chat.completions.create(n=3, **ask)
    single = client.chat.completions.create(n=1, **ask)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert texts[0] == single.choices[0].message.content and len(set(texts)) > 1
    assert first.usage.prompt_tokens == single.usage.prompt_tokens
    assert single.usage.completion_tokens < first.usage.completion_tokens <= 3 * 8
    stream = client.chat.completions.create(n=3, stream=True, **ask)
    streamed = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts


def test_completions_n_per_prompt(server):
    """Two prompts, n = 2: choice p * 2 + i is the i-th choice of prompt p; each prompt's
    tokens count once."""
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    reply = client.completions.create(model=server.model, prompt=prompts, n=2, max_tokens=4,
                                      temperature=0)  # fmt: skip
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    texts = [c.text for c in reply.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy copies agree
    assert reply.usage.prompt_tokens == 7
