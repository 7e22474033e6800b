"""vLLM's request extensions that change the output: prompt truncation, token ids in the
response, logprobs' tokens as ids, a completion prompt's special tokens."""

from __future__ import annotations

import shutil
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer, processors

from tests.server.conftest import start_server, stop_server
from tests.server.helpers import MESSAGES, PROMPT, assert_error, sse_payloads, tokenize

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
IDS = list(range(100, 120))  # a 20-token prompt


def post(server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize(("side", "kept"), [(None, IDS[-8:]), ("left", IDS[-8:]),
                                            ("right", IDS[:8])])  # fmt: skip
def test_truncate_prompt_tokens_keeps_one_end_of_the_prompt(server, side, kept):
    body = {"prompt": IDS, "max_tokens": 2, "truncate_prompt_tokens": 8, "return_token_ids": True}
    if side is not None:
        body["truncation_side"] = side
    reply = post(server, COMPLETIONS, body)
    assert reply["choices"][0]["prompt_token_ids"] == kept
    assert reply["usage"]["prompt_tokens"] == 8


def test_truncate_prompt_tokens_in_chat_and_when_the_prompt_is_shorter(server):
    full = tokenize(server, messages=MESSAGES)
    body = {"messages": MESSAGES, "max_tokens": 2, "truncate_prompt_tokens": 5}
    assert post(server, CHAT, body)["usage"]["prompt_tokens"] == 5
    body["truncate_prompt_tokens"] = len(full) + 10
    assert post(server, CHAT, body)["usage"]["prompt_tokens"] == len(full)
    echoed = post(server, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 1, "echo": True,
                                        "truncate_prompt_tokens": 2})  # fmt: skip
    kept = httpx.post(
        server.url + "/detokenize", json={"tokens": tokenize(server, prompt=PROMPT)[-2:]}
    )
    assert echoed["choices"][0]["text"].startswith(kept.json()["prompt"])


@pytest.mark.parametrize("value", [0, -2, 10_000])
def test_truncate_prompt_tokens_out_of_range_is_a_400(server, value):
    body = {"prompt": PROMPT, "max_tokens": 2, "truncate_prompt_tokens": value}
    response = httpx.post(server.url + COMPLETIONS, json=body, timeout=30)
    assert_error(response, 400, param="truncate_prompt_tokens")


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_return_token_ids_whole_and_streamed(server, path):
    body: dict[str, Any] = {"max_tokens": 6, "temperature": 0, "return_token_ids": True}
    body |= {"prompt": PROMPT} if path == COMPLETIONS else {"messages": MESSAGES}
    prompt_ids = tokenize(server, **({"prompt": PROMPT} if path == COMPLETIONS else
                                     {"messages": MESSAGES}))  # fmt: skip
    whole = post(server, path, body)
    choice = whole["choices"][0]
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == 6
    owner = choice if path == COMPLETIONS else whole
    assert owner["prompt_token_ids"] == prompt_ids
    raw = httpx.post(server.url + path, json=body | {"stream": True}, timeout=60).content
    chunks = [c for c in sse_payloads(raw) if c["choices"]]
    streamed = [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
    assert streamed == choice["token_ids"]
    owners = [c["choices"][0] if path == COMPLETIONS else c for c in chunks]
    assert [o["prompt_token_ids"] for o in owners if o.get("prompt_token_ids")] == [prompt_ids]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_token_ids_and_prompt_logprobs_are_null_unless_asked(server, path):
    body = {"prompt": PROMPT} if path == COMPLETIONS else {"messages": MESSAGES}
    reply = post(server, path, body | {"max_tokens": 2})
    assert reply["choices"][0]["token_ids"] is None
    owner = reply["choices"][0] if path == COMPLETIONS else reply
    assert owner["prompt_logprobs"] is None and owner["prompt_token_ids"] is None


def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(server):
    body = {"prompt": PROMPT, "max_tokens": 4, "logprobs": 2, "return_token_ids": True,
            "temperature": 0}  # fmt: skip
    by_text = post(server, COMPLETIONS, body)["choices"][0]
    choice = post(server, COMPLETIONS, body | {"return_tokens_as_token_ids": True})["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for k in top)
    # Offsets still count the text's characters.
    assert choice["logprobs"]["text_offset"] == by_text["logprobs"]["text_offset"]
    body = {"messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": 2,
            "return_token_ids": True, "return_tokens_as_token_ids": True}  # fmt: skip
    choice = post(server, CHAT, body)["choices"][0]
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in choice["token_ids"]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_are_the_only_tokens_sampled(server, temperature):
    allowed = [42, 43, 44]
    body = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "seed": 1,
            "temperature": temperature, "allowed_token_ids": allowed,
            "return_token_ids": True}  # fmt: skip
    choice = post(server, COMPLETIONS, body)["choices"][0]
    assert len(choice["token_ids"]) == 12 and set(choice["token_ids"]) <= set(allowed)


def test_bad_words_are_never_written(server):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    plain = post(server, COMPLETIONS, body)["choices"][0]["token_ids"]
    # A word the greedy answer writes as one token of its own.
    for token in plain:
        word = httpx.post(server.url + "/detokenize", json={"tokens": [token]}).json()["prompt"]
        spellings = [tokenize(server, prompt=w) for w in (word.lstrip(), " " + word.lstrip())]
        if word.strip() and [token] in spellings:
            break
    else:
        pytest.skip("the greedy answer has no single-token word")
    again = post(server, COMPLETIONS, body | {"bad_words": [word]})["choices"][0]["token_ids"]
    assert token not in again and again != plain


@pytest.mark.parametrize(
    ("field", "value"),
    [("allowed_token_ids", []), ("allowed_token_ids", [10**6]), ("bad_words", [" "])],
)
def test_bad_token_lists_are_a_400(server, field, value):
    body = {"prompt": PROMPT, "max_tokens": 2, field: value}
    response = httpx.post(server.url + COMPLETIONS, json=body, timeout=30)
    assert_error(response, 400, param=field)


CONTINUED = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]


def test_continue_final_message_leaves_the_last_message_open(server):
    ids = tokenize(server, messages=CONTINUED, add_generation_prompt=False,
                   continue_final_message=True)  # fmt: skip
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30).json()
    assert text["prompt"].endswith("The answer is")
    closed = tokenize(server, messages=CONTINUED, add_generation_prompt=False)
    assert closed[: len(ids)] == ids and len(closed) > len(ids)
    body = {"messages": CONTINUED, "add_generation_prompt": False,
            "continue_final_message": True, "max_tokens": 2}  # fmt: skip
    assert post(server, CHAT, body)["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize(
    "body",
    [
        {"messages": CONTINUED, "continue_final_message": True},  # with add_generation_prompt
        {"messages": [*MESSAGES, {"role": "assistant", "content": ""}],
         "add_generation_prompt": False, "continue_final_message": True},
    ],
    ids=["with-generation-prompt", "nothing-to-continue"],
)  # fmt: skip
def test_continue_final_message_that_cannot_be_honoured_is_a_400(server, body):
    response = httpx.post(server.url + CHAT, json=body | {"max_tokens": 2}, timeout=30)
    assert_error(response, 400, param="continue_final_message")


def test_prompt_logprobs_in_vllms_shape(server):
    """Per prompt token (null for the first): the token itself and the most likely ones, keyed
    by id, with the same scores echo reports."""
    ids = [11, 22, 33, 44, 55]
    body = {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}
    scored = post(server, COMPLETIONS, body)["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    echoed = post(server, COMPLETIONS, {"prompt": ids, "max_tokens": 1, "echo": True,
                                        "logprobs": 2})["choices"][0]["logprobs"]  # fmt: skip
    for i, (token, position) in enumerate(zip(ids[1:], scored[1:], strict=True), 1):
        assert 2 <= len(position) <= 3 and str(token) in position
        entry = position[str(token)]
        assert set(entry) == {"logprob", "rank", "decoded_token"} and entry["rank"] >= 1
        assert entry["logprob"] == pytest.approx(echoed["token_logprobs"][i], abs=1e-5)
    body = {"messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 0}
    reply = post(server, CHAT, body)
    assert len(reply["prompt_logprobs"]) == reply["usage"]["prompt_tokens"]
    assert all(len(p) == 1 for p in reply["prompt_logprobs"][1:])


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_continuous_usage_stats_put_usage_in_every_chunk(server, path):
    body: dict[str, Any] = {"max_tokens": 5, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}  # fmt: skip
    body |= {"prompt": PROMPT} if path == COMPLETIONS else {"messages": MESSAGES}
    raw = httpx.post(server.url + path, json=body, timeout=60).content
    payloads = sse_payloads(raw)
    chunks, final = payloads[:-1], payloads[-1]
    assert all(c["choices"] and c["usage"] for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {final["usage"]["prompt_tokens"]}
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + n
               for c, n in zip(chunks, counts, strict=True))  # fmt: skip
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 5


@pytest.fixture(scope="module")
def bos_server(tiny_model, tmp_path_factory):
    """A server on a copy of the tiny checkpoint whose tokenizer starts every prompt with a
    BOS (as Llama's and DeepSeek's do; Qwen's adds nothing)."""
    model = tmp_path_factory.mktemp("bos-model")
    shutil.copytree(tiny_model, model, dirs_exist_ok=True)
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    bos = "<|endoftext|>"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))]
    )
    tokenizer.save(str(model / "tokenizer.json"))
    log = tmp_path_factory.mktemp("bos-log") / "server.log"
    running = start_server(model, log, "--max-model-len", "512")
    yield running, tokenizer.token_to_id(bos)
    stop_server(running)


def test_add_special_tokens_decides_whether_a_completion_prompt_gets_a_bos(bos_server):
    server, bos = bos_server
    body = {"prompt": PROMPT, "max_tokens": 1, "return_token_ids": True}
    default = post(server, COMPLETIONS, body)["choices"][0]["prompt_token_ids"]
    without = post(server, COMPLETIONS, body | {"add_special_tokens": False})
    without_ids = without["choices"][0]["prompt_token_ids"]
    assert default[0] == bos and default[1:] == without_ids and bos not in without_ids
    assert without["usage"]["prompt_tokens"] == len(default) - 1
