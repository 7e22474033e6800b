"""Structured output over HTTP with the openai SDK: response_format json_schema and
json_object on chat, vLLM's structured_outputs and guided_* on completions, streamed and not."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from pegainfer.core.sampling.structured_output import Grammars, StructuredOutput
from pegainfer.core.text.tokenizer import Tokenizer
from pegainfer.server.structured import ascii_digits
from tests.server.helpers import assert_error, assert_serving, sse_payloads

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "warm"],
          "properties": {"city": {"type": "string", "maxLength": 6},
                         "warm": {"type": "boolean"}}}  # fmt: skip


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none")


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schema(client, server, stream):
    """n = 3 answers of one request, each valid against the schema."""
    schema = {"name": "weather", "schema": SCHEMA, "strict": True}
    response_format = {"type": "json_schema", "json_schema": schema}
    kwargs = dict(model=server.model, messages=[{"role": "user", "content": "Weather?"}],
                  response_format=response_format, max_tokens=120, n=3, seed=4)  # fmt: skip
    if stream:
        texts = ["", "", ""]
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
    else:
        reply = client.chat.completions.create(**kwargs)
        texts = [choice.message.content for choice in reply.choices]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_chat_json_object(client, server, tiny_model):
    """Any object: a random model is still writing its first string at max_tokens, so each
    answer is checked as the start of a JSON object, by a matcher of its own."""
    reply = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"}, max_tokens=40, seed=1, n=4,
    )  # fmt: skip
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    grammars = Grammars(lambda: Tokenizer.from_dir(tiny_model), vocab)
    for choice in reply.choices:
        text = choice.message.content
        matcher = grammars.matcher(StructuredOutput.json_schema({"type": "object"}), [0])
        assert text.startswith("{") and matcher.consume_tokens(
            grammars.tokenizer([0]).tokenize_str(text)
        ), text


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"structured_outputs": {"regex": r"\d{3}-[a-c]{1,4}"}},
         lambda text: re.fullmatch(r"\d{3}-[a-c]{1,4}", text)),
        ({"guided_choice": ["yes", "no", "maybe not"]},
         lambda text: text in {"yes", "no", "maybe not"}),
        ({"structured_outputs": {"json": SCHEMA}},
         lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
    ],
)  # fmt: skip
def test_completions_constraints(client, server, extra, check):
    reply = client.completions.create(model=server.model, prompt=["Answer:", "Now:"],
                                      max_tokens=60, seed=2, extra_body=extra)  # fmt: skip
    for choice in reply.choices:
        assert check(choice.text), choice.text


def test_a_grammar_failing_on_its_first_mask_is_a_400(server):
    body = {"prompt": "x", "max_tokens": 5, "guided_json": {"$ref": "#"}}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert_error(response, 400, param="guided_json")


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_failing_mid_generation_ends_with_an_error_not_stop(server, stream):
    """It answered finish_reason "stop" with text that broke the regex, and logged nothing."""
    body = {"prompt": "x", "max_tokens": 50, "guided_regex": "(a{1000}){1000}", "stream": stream}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    if stream:
        assert response.status_code == 200
        payloads = sse_payloads(response.content)
        assert "error" in payloads[-1] and all(
            c["choices"][0]["finish_reason"] != "stop" for c in payloads[:-1]
        )
    else:
        assert_error(response, 500)
    assert "grammar failed" in server.logs()
    # The client is told why, not only that the engine failed.
    assert "grammar failed after" in response.text
    assert_serving(server.url)


@pytest.mark.parametrize(
    ("regex", "expected"),
    [
        (r"\d+", "[0-9]+"),
        (r"[\d.]+", "[0-9.]+"),
        (r"[^\d]", "[^0-9]"),
        (r"[]\d]", "[]0-9]"),
        (r"\D\\d", r"[^0-9]\\d"),
        (r"a\.b\w", r"a\.b\w"),
    ],
)
def test_a_regex_digit_class_means_ascii_digits(regex, expected):
    """`\\d` in a regex is [0-9], as vLLM's xgrammar and JSON Schema read it; an escaped
    backslash before a `d` is left alone."""
    assert ascii_digits(regex) == expected


# Qwen's `<think>`, `</think>`, `<tool_call>` are added tokens that are not special: text to a
# grammar, which the model may write as the one token. A grammar holding them failed every
# request with a 500 after its first token.
THINK_REGEX = r"<think>[a-z]{1,8}</think>"
TAGS = ["<tool_call>", "</think>", "<|im_end|>"]
TAGGED_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["tag"],
                 "properties": {"tag": {"enum": TAGS}}}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"structured_outputs": {"regex": THINK_REGEX}},
         lambda text: re.fullmatch(THINK_REGEX, text)),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "tag", "schema": TAGGED_SCHEMA}}},
         lambda text: jsonschema.validate(json.loads(text), TAGGED_SCHEMA) is None),
    ],
    ids=["regex", "json_schema"],
)  # fmt: skip
def test_chat_constraints_holding_added_tokens_text(server, extra, check, stream):
    """The server splits Qwen3's thinking off (its line's reasoning parser): the answer is the
    thinking back in its tags, then the content."""
    body = {"model": server.model, "messages": [{"role": "user", "content": "Think."}],
            "max_tokens": 60, "seed": 3, "n": 3, "stream": stream, **extra}  # fmt: skip
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    reasonings, contents, reasons = [""] * 3, [""] * 3, [None] * 3
    if stream:
        choices = [c for p in sse_payloads(response.content) for c in p["choices"]]
        messages = [c["delta"] for c in choices]
    else:
        choices = response.json()["choices"]
        messages = [c["message"] for c in choices]
    for choice, message in zip(choices, messages, strict=True):
        reasonings[choice["index"]] += message.get("reasoning_content") or ""
        contents[choice["index"]] += message.get("content") or ""
        reasons[choice["index"]] = choice["finish_reason"] or reasons[choice["index"]]
    assert reasons == ["stop"] * 3
    for reasoning, content in zip(reasonings, contents, strict=True):
        text = (f"<think>{reasoning}</think>" if reasoning else "") + content
        assert check(text), text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"structured_outputs": {"grammar": "start: <think>"}},
         'unknown special token: \\"<think>\\"'),
        ({"guided_regex": "a[^\\s\\S]"}, "no answer can satisfy it"),
        ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "Unsatisfiable"),
    ],
    ids=["lark-names-a-text-token", "empty-regex", "empty-schema"],
)  # fmt: skip
def test_a_grammar_nothing_can_satisfy_is_a_clear_400(server, extra, message):
    """A Lark grammar naming `<think>` as a special token (it is text), and constraints no
    text matches."""
    body = {"prompt": "x", "max_tokens": 5, **extra}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert_error(response, 400)
    assert message in response.text, response.text


def test_a_constraint_with_bad_words_banning_its_forced_tokens(server):
    """The grammar forces "hello world", whose own tokens the request bans: the answer spells
    it in others (it was a 500 after one token)."""
    body = {"prompt": "x", "max_tokens": 30, "temperature": 0, "bad_words": ["hello", "world"],
            "structured_outputs": {"choice": ["hello world"]}}  # fmt: skip
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["text"] == "hello world" and choice["finish_reason"] == "stop"
