"""The small endpoints: /health, /v1/models, /version, /tokenize and /detokenize."""

from __future__ import annotations

import httpx
import pytest

from tests.server.helpers import MESSAGES, tokenize


def test_health(server):
    response = httpx.get(server.url + "/health", timeout=30)
    assert response.status_code == 200


def test_models_lists_the_served_name(server):
    response = httpx.get(server.url + "/v1/models", timeout=30)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == server.model
    assert card["object"] == "model"
    assert card["max_model_len"] == 512
    assert isinstance(card["created"], int) and isinstance(card["owned_by"], str)


def test_version(server):
    response = httpx.get(server.url + "/version", timeout=30)
    assert response.status_code == 200
    version = response.json()["version"]
    assert isinstance(version, str) and version and version != "unknown"


@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog.",
        "naïve café — 東京 🚀 emoji",
        "def f(x):\n    return x * 2\n",
    ],
    ids=["ascii", "multibyte", "code"],
)
def test_tokenize_detokenize_round_trip(server, text):
    response = httpx.post(server.url + "/tokenize", json={"prompt": text}, timeout=30)
    assert response.status_code == 200
    body = response.json()
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == 512
    assert all(isinstance(t, int) for t in body["tokens"])
    response = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]}, timeout=30)
    assert response.status_code == 200
    assert response.json() == {"prompt": text}


def test_tokenize_counts_what_completions_charge(server):
    text = "Call me Ishmael."
    ids = tokenize(server, prompt=text)
    body = {"prompt": text, "max_tokens": 1}
    usage = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()["usage"]
    assert usage["prompt_tokens"] == len(ids)


def test_tokenize_messages_applies_the_chat_template(server):
    with_prompt = tokenize(server, messages=MESSAGES)
    without = tokenize(server, messages=MESSAGES, add_generation_prompt=False)
    assert len(with_prompt) > len(without)
    assert with_prompt[: len(without)] == without
    rendered = httpx.post(server.url + "/detokenize", json={"tokens": with_prompt}).json()
    for message in MESSAGES:
        assert message["content"] in rendered["prompt"]
    assert "assistant" in rendered["prompt"][len(rendered["prompt"]) // 2 :]


def test_logit_bias_steers_every_token(server):
    """A +100 bias on one token makes greedy decoding emit it every time; -100 bans it."""
    import httpx

    body = {"model": server.model, "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0}
    plain = httpx.post(f"{server.base_url}/completions", json=body, timeout=30).json()
    forced = httpx.post(f"{server.base_url}/completions", timeout=30,
                        json=body | {"logit_bias": {"42": 100}}).json()  # fmt: skip
    sixes = httpx.post(f"{server.url}/detokenize", timeout=30,
                       json={"model": server.model, "tokens": [42] * 6}).json()  # fmt: skip
    assert forced["choices"][0]["text"] == sixes["prompt"] != plain["choices"][0]["text"]
