"""vLLM's tests/entrypoints/openai/chat_completion/test_chat.py, behaviour for behaviour.

Random weights: text is checked for shape, determinism and constraints, never for meaning. The
LoRA parametrizations are not ported (README.md in this folder).
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.server.helpers import tokenize

MESSAGES = [
    {"role": "system", "content": "you are a helpful assistant"},
    {"role": "user", "content": "what is 1+1?"},
]
HISTORY = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Who won the world series in 2020?"},
    {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
    {"role": "user", "content": "Where was it played?"},
]
CHOICES = ["Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript", "Ruby", "Swift"]
# vLLM's sample_json_schema, with bounds so that a random model's answer ends in 200 tokens.
EMPLOYEE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 1},
    },
    "required": ["name", "age", "skills"],
    "additionalProperties": False,
}
IP_REGEX = r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"


def test_no_logprobs_chat(client, server):
    """test_no_logprobs_chat: logprobs=False gives choice.logprobs None."""
    reply = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_completion_tokens=5, temperature=0.0,
        logprobs=False,
    )  # fmt: skip
    assert reply.choices[0].logprobs is None


@pytest.mark.parametrize("top_logprobs", [0, 5])
def test_zero_and_some_logprobs_chat(client, server, top_logprobs):
    """test_zero_logprobs_chat, test_some_logprobs_chat: exactly top_logprobs alternatives per
    token (none for 0), one entry per completion token."""
    reply = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_completion_tokens=5, temperature=0.0,
        logprobs=True, top_logprobs=top_logprobs,
    )  # fmt: skip
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert all(len(entry.top_logprobs) == top_logprobs for entry in content)


def test_too_many_chat_logprobs(client, server):
    """test_too_many_chat_logprobs: top_logprobs above 20 is a 400, streamed or not; the
    server still answers afterwards."""
    kwargs = dict(model=server.model, messages=MESSAGES, max_completion_tokens=10, logprobs=True)
    with pytest.raises(openai.BadRequestError):
        for _ in client.chat.completions.create(top_logprobs=21, stream=True, **kwargs):
            pass
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(top_logprobs=30, **kwargs)
    reply = client.chat.completions.create(model=server.model, messages=MESSAGES,
                                           max_completion_tokens=10)  # fmt: skip
    assert reply.choices[0].message.content is not None


@pytest.mark.parametrize("prompt_logprobs", [1, 0, -1, None])
def test_prompt_logprobs_chat(client, server, prompt_logprobs):
    """test_prompt_logprobs_chat: the response's prompt_logprobs cover the rendered prompt
    (None first); negative is a 400; absent is null."""
    extra = {} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs}
    kwargs = dict(model=server.model, messages=HISTORY, max_completion_tokens=2, extra_body=extra)
    if prompt_logprobs is not None and prompt_logprobs < 0:
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**kwargs)
        return
    reply = client.chat.completions.create(**kwargs)
    result = reply.model_extra["prompt_logprobs"]
    if prompt_logprobs is None:
        assert result is None
    else:
        assert len(result) == reply.usage.prompt_tokens and result[0] is None


def test_more_than_one_prompt_logprobs_chat(client, server):
    """test_more_than_one_prompt_logprobs_chat: prompt_logprobs k gives the prompt's token plus
    the top k at each position (k entries when the token is among them)."""
    prompt_ids = tokenize(server, messages=HISTORY)
    for k in (1, 2):
        reply = client.chat.completions.create(
            model=server.model, messages=HISTORY, max_completion_tokens=2,
            extra_body={"prompt_logprobs": k},
        )  # fmt: skip
        position = reply.model_extra["prompt_logprobs"][3]
        assert str(prompt_ids[3]) in position
        assert k <= len(position) <= k + 1


def test_single_chat_session(client, server):
    """test_single_chat_session: id, one choice, finish_reason length, usage exactly the
    rendered prompt's tokens plus max_completion_tokens; a second turn answers too."""
    reply = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_completion_tokens=5, logprobs=True,
        top_logprobs=5, extra_body={"ignore_eos": True},
    )  # fmt: skip
    prompt_tokens = len(tokenize(server, messages=MESSAGES))
    assert reply.id and len(reply.choices) == 1
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, 5)
    assert usage.total_tokens == prompt_tokens + 5
    assert choice.message.role == "assistant" and choice.message.content

    turns = [*MESSAGES, {"role": "assistant", "content": choice.message.content},
             {"role": "user", "content": "express your result in json"}]  # fmt: skip
    reply = client.chat.completions.create(model=server.model, messages=turns,
                                           max_completion_tokens=5)  # fmt: skip
    assert reply.choices[0].message.content is not None


def test_chat_streaming(client, server):
    """test_chat_streaming: the streamed deltas join to the whole answer, role assistant, one
    finish_reason (the whole answer's) on the last chunk."""
    kwargs = dict(model=server.model, messages=MESSAGES, max_completion_tokens=10, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    pieces, reasons = [], []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        assert delta.role in (None, "assistant")
        pieces.append(delta.content or "")
        reasons.append(chunk.choices[0].finish_reason)
    assert [r for r in reasons if r] == [whole.finish_reason] == [reasons[-1]]
    assert "".join(pieces) == whole.message.content


def test_chat_completion_stream_options(client, server):
    """test_chat_completion_stream_options: no usage unless asked; include_usage adds a final
    chunk with no choices; stream_options without stream is a 400; continuous_usage_stats
    counts completion tokens up on every chunk, to exactly min_tokens = max tokens = 10."""
    kwargs = dict(model=server.model, messages=MESSAGES, max_completion_tokens=10, temperature=0)
    for chunk in client.chat.completions.create(
        stream=True, stream_options={"include_usage": False}, **kwargs
    ):
        assert chunk.usage is None
    *answer, final = client.chat.completions.create(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": False},
        **kwargs,
    )  # fmt: skip
    assert all(chunk.usage is None for chunk in answer)
    assert final.choices == [] and final.usage.completion_tokens > 0
    assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens
    for options in ({"include_usage": None}, {"include_usage": True}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(stream=False, stream_options=options, **kwargs)

    last = 0
    for chunk in client.chat.completions.create(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"min_tokens": 10}, **kwargs,
    ):  # fmt: skip
        usage = chunk.usage
        assert usage.prompt_tokens > 0
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert (
            last == 0
            or usage.completion_tokens > last
            or (not chunk.choices and usage.completion_tokens == last)
        )
        last = usage.completion_tokens
    assert last == 10


def test_structured_outputs_choice_chat(client, server):
    """test_structured_outputs_choice_chat: the answer is one of the choices, over two turns."""
    messages = [{"role": "user", "content": "The best language for type-safe systems is "}]
    extra = {"structured_outputs": {"choice": CHOICES}}
    first = client.chat.completions.create(
        model=server.model, messages=messages, max_completion_tokens=10, temperature=0.7,
        extra_body=extra,
    ).choices[0].message.content  # fmt: skip
    assert first in CHOICES
    messages += [{"role": "assistant", "content": first},
                 {"role": "user", "content": "I disagree, pick another one"}]  # fmt: skip
    second = client.chat.completions.create(
        model=server.model, messages=messages, max_completion_tokens=10, temperature=0.7,
        extra_body=extra,
    ).choices[0].message.content  # fmt: skip
    assert second in CHOICES


def test_structured_outputs_json_chat(client, server):
    """test_structured_outputs_json_chat: the answer parses and validates against the schema,
    over two turns (random weights: the two answers need not differ)."""
    messages = [{"role": "user", "content": f"An employee as JSON: {EMPLOYEE}"}]
    for _ in range(2):
        content = client.chat.completions.create(
            model=server.model, messages=messages, max_completion_tokens=200, seed=7,
            extra_body={"structured_outputs": {"json": EMPLOYEE}},
        ).choices[0].message.content  # fmt: skip
        jsonschema.validate(json.loads(content), EMPLOYEE)
        messages += [{"role": "assistant", "content": content},
                     {"role": "user", "content": "Another one"}]  # fmt: skip


def test_structured_outputs_regex_chat(client, server):
    """test_structured_outputs_regex_chat: the answer matches the regex whole, over two turns."""
    messages = [{"role": "user", "content": f"An IP address: {IP_REGEX}"}]
    for _ in range(2):
        ip = client.chat.completions.create(
            model=server.model, messages=messages, max_completion_tokens=20, seed=3,
            extra_body={"structured_outputs": {"regex": IP_REGEX}},
        ).choices[0].message.content  # fmt: skip
        assert re.fullmatch(IP_REGEX, ip), ip
        messages += [{"role": "assistant", "content": ip},
                     {"role": "user", "content": "Give me a different one"}]  # fmt: skip


def test_structured_outputs_type_error(client, server):
    """test_structured_outputs_type_error: a regex that is not a string is a 400."""
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=server.model, messages=MESSAGES,
            extra_body={"structured_outputs": {"regex": {1: "Python", 2: "C++"}}},
        )  # fmt: skip


def test_structured_outputs_choice_chat_logprobs(client, server):
    """test_structured_outputs_choice_chat_logprobs: alternatives the grammar masks out are
    still finite numbers no lower than OpenAI's floor of -9999."""
    reply = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_completion_tokens=10, logprobs=True,
        top_logprobs=5, extra_body={"structured_outputs": {"choice": CHOICES}},
    )  # fmt: skip
    for entry in reply.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 5
        assert all(item.logprob >= -9999.0 for item in entry.top_logprobs), entry


def test_response_format_json_object(client, server):
    """test_response_format_json_object: the answer starts a JSON object (a random model may
    still be inside its first string when max tokens ends it; the whole-object case is
    test_response_format_json_schema's)."""
    reply = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"}, max_completion_tokens=20, seed=0,
    )  # fmt: skip
    content = reply.choices[0].message.content
    assert content.startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_response_format_json_schema(client, server):
    """test_response_format_json_schema: `{"result": integer}` answers parse to exactly that
    shape, twice."""
    schema = {"type": "object", "properties": {"result": {"type": "integer", "maximum": 9}},
              "required": ["result"], "additionalProperties": False}  # fmt: skip
    for seed in (0, 1):
        reply = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "what is 1+1?"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "foo_test", "schema": schema}},
            max_completion_tokens=40, seed=seed,
        )  # fmt: skip
        loaded = json.loads(reply.choices[0].message.content)
        assert set(loaded) == {"result"} and isinstance(loaded["result"], int)


def test_response_format_text(client, server):
    """test_response_format_text: `text` is no constraint."""
    kwargs = dict(model=server.model, messages=[{"role": "user", "content": "what is 1+1?"}],
                  max_completion_tokens=10, temperature=0)  # fmt: skip
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    text = client.chat.completions.create(response_format={"type": "text"}, **kwargs)
    assert text.choices[0].message.content == plain


def test_extra_fields_allowed(client, server):
    """test_extra_fields_allowed: an unknown field in a message is accepted."""
    reply = client.chat.completions.create(
        model=server.model, temperature=0, seed=0, max_completion_tokens=5,
        messages=[{"role": "user", "content": "what is 1+1?", "extra_field": "0"}],
    )  # fmt: skip
    assert reply.choices[0].message.content is not None


def test_complex_message_content(client, server):
    """test_complex_message_content: content as a list of text parts answers exactly as the
    same text as a string (greedy)."""
    text = "what is 1+1? please provide the result without any other text."
    answers = []
    for content in (text, [{"type": "text", "text": text}]):
        reply = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": content}],
            temperature=0, seed=0, max_completion_tokens=8,
        )  # fmt: skip
        answers.append(reply.choices[0].message.content)
    assert answers[0] == answers[1]


@pytest.mark.parametrize("content", ["what is 1+1?", [{"type": "text", "text": "what is 1+1?"}]])
def test_custom_role(client, server, content):
    """test_custom_role, where we differ on purpose: vLLM hands a custom role to the chat
    template, and Qwen's templates leave such a message out of the prompt without a word. We
    refuse it with a 400 naming the role, for string and list content alike (README)."""
    with pytest.raises(openai.BadRequestError, match="my-custom-role"):
        client.chat.completions.create(
            model=server.model, messages=[{"role": "my-custom-role", "content": content}],
            temperature=0, seed=0, max_completion_tokens=8,
        )  # fmt: skip


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**63])
def test_long_seed(client, server, seed):
    """test_long_seed: a seed outside a signed 64-bit integer is a 400."""
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=server.model, messages=[{"role": "system", "content": "You are helpful."}],
            temperature=0, seed=seed,
        )  # fmt: skip


def test_invocations(server):
    """test_invocations: /invocations with a chat body answers as /v1/chat/completions, the
    same keys and (greedy) the same choices."""
    body = dict(model=server.model, messages=MESSAGES, max_completion_tokens=5, temperature=0.0,
                logprobs=False)  # fmt: skip
    answers = []
    for path in ("/v1/chat/completions", "/invocations"):
        response = httpx.post(server.url + path, json=body, timeout=30)
        assert response.status_code == 200, response.text
        answers.append(response.json())
    chat, invocation = answers
    assert chat.keys() == invocation.keys()
    assert chat["object"] == invocation["object"] == "chat.completion"
    assert chat["choices"] == invocation["choices"]


def test_chat_completion_n_parameter_non_streaming(client, server):
    """test_chat_completion_n_parameter_non_streaming: n=3 gives indexed choices, not all equal."""
    reply = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_completion_tokens=10, temperature=0.7, n=3,
    )  # fmt: skip
    assert [choice.index for choice in reply.choices] == [0, 1, 2]
    contents = [choice.message.content for choice in reply.choices]
    assert all(contents) and len(set(contents)) > 1


def test_chat_completion_n_parameter_streaming(client, server):
    """test_chat_completion_n_parameter_streaming: both choices of an n=2 stream get content."""
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_completion_tokens=15, temperature=0.7, n=2,
        stream=True, extra_body={"ignore_eos": True},
    ):  # fmt: skip
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] and texts[1]


def test_chat_completion_n_with_seed(client, server):
    """test_chat_completion_n_with_seed: n=2 with a seed answers two choices, the same each time."""
    kwargs = dict(model=server.model, messages=[{"role": "user", "content": "Say hello."}],
                  max_completion_tokens=10, temperature=0.8, n=2, seed=42)  # fmt: skip
    first = client.chat.completions.create(**kwargs)
    assert [choice.index for choice in first.choices] == [0, 1]
    again = client.chat.completions.create(**kwargs)
    contents = [choice.message.content for choice in first.choices]
    assert all(contents)
    assert contents == [choice.message.content for choice in again.choices]


def test_chat_completion_n_equals_1(client, server):
    """test_chat_completion_n_equals_1: n=1 is one choice at index 0."""
    reply = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hello!"}],
        max_completion_tokens=10, temperature=0.7, n=1,
    )  # fmt: skip
    assert [choice.index for choice in reply.choices] == [0]
    assert reply.choices[0].message.content is not None
