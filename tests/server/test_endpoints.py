"""The small endpoints: /health, /v1/models, /version, /tokenize and /detokenize."""

from __future__ import annotations

import httpx
import pytest

from tests.server.helpers import MESSAGES, assert_error, sse_payloads, tokenize


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


def test_one_model_by_name(server):
    listed = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
    response = httpx.get(server.url + "/v1/models/" + server.model, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json() == listed
    response = httpx.get(server.url + "/v1/models/gpt-4", timeout=30)
    assert_error(response, 404, param="model", code="model_not_found")


def test_invocations_serves_chat_and_completions(server):
    chat = {"messages": MESSAGES, "max_tokens": 2}
    response = httpx.post(server.url + "/invocations", json=chat, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "chat.completion"
    completion = {"prompt": "Hello", "max_tokens": 2, "stream": True}
    response = httpx.post(server.url + "/invocations", json=completion, timeout=30)
    assert response.status_code == 200, response.text
    assert sse_payloads(response.content)[0]["object"] == "text_completion"
    response = httpx.post(server.url + "/invocations", json={"max_tokens": 2}, timeout=30)
    assert_error(response, 400, contains="messages")


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/no/such/route", 404, "not_found"),
        ("POST", "/v1/embeddings", 404, "not_found"),
        ("GET", "/v1/completions", 405, "method_not_allowed"),
        ("DELETE", "/health", 405, "method_not_allowed"),
    ],
)
def test_unknown_routes_and_methods_are_json_errors(server, method, path, status, code):
    response = httpx.request(method, server.url + path, timeout=30)
    assert_error(response, status, code=code, contains=path)
    if status == 405:
        assert "GET" in response.headers["allow"] or "POST" in response.headers["allow"]


def test_tokenize_renders_tools_and_returns_token_strings(server):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    plain = tokenize(server, messages=MESSAGES)
    with_tools = tokenize(server, messages=MESSAGES, tools=tools)
    assert len(with_tools) > len(plain)
    text = httpx.post(server.url + "/detokenize", json={"tokens": with_tools}, timeout=30)
    assert "get_weather" in text.json()["prompt"]
    body = {"prompt": "Hello world", "return_token_strs": True}
    payload = httpx.post(server.url + "/tokenize", json=body, timeout=30).json()
    assert len(payload["token_strs"]) == payload["count"]
    assert "".join(payload["token_strs"]).replace("Ġ", " ") == "Hello world"
    plain_payload = httpx.post(server.url + "/tokenize", json={"prompt": "x"}, timeout=30).json()
    assert plain_payload["token_strs"] is None


def test_a_developer_message_is_rendered_as_system(server):
    """Qwen3's template has no developer role: it was silently left out of the prompt."""
    as_system = tokenize(server, messages=MESSAGES)
    developer = [{"role": "developer", "content": MESSAGES[0]["content"]}, *MESSAGES[1:]]
    assert tokenize(server, messages=developer) == as_system
