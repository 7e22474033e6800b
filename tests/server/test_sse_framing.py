"""Server-sent events on the wire, read with raw httpx: framing, role chunk, usage chunk."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.helpers import MESSAGES, PROMPT, assert_error, sse_payloads, tokenize

N = 6


def stream(server, path: str, body: dict[str, Any]) -> tuple[httpx.Response, bytes]:
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as response:
        raw = response.read()
    return response, raw


def check_headers(response: httpx.Response) -> None:
    assert response.status_code == 200
    assert response.headers["content-type"].split(";")[0] == "text/event-stream"
    assert response.headers["cache-control"] == "no-cache"


def completion_body(**extra: Any) -> dict[str, Any]:
    return {
        "prompt": PROMPT,
        "max_tokens": N,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    } | extra


def chat_body(**extra: Any) -> dict[str, Any]:
    return {
        "messages": MESSAGES,
        "max_tokens": N,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    } | extra


def test_completion_events_with_usage(server):
    response, raw = stream(
        server, "/v1/completions", completion_body(stream_options={"include_usage": True})
    )
    check_headers(response)
    payloads = sse_payloads(raw)
    *content, last = payloads
    # One token per chunk, except that a reader behind gets the tokens queued meanwhile in one.
    assert 1 <= len(content) <= N
    for chunk in content:
        assert chunk["object"] == "text_completion"
        assert chunk.get("usage") is None
        (choice,) = chunk["choices"]
        assert choice["index"] == 0
        assert isinstance(choice["text"], str)
    reasons = [c["choices"][0]["finish_reason"] for c in content]
    assert reasons == [None] * (len(reasons) - 1) + ["length"]
    assert len({c["id"] for c in payloads}) == 1
    assert last["choices"] == []
    usage = last["usage"]
    assert usage["completion_tokens"] == N
    assert usage["prompt_tokens"] == len(tokenize(server, prompt=PROMPT))
    assert usage["total_tokens"] == usage["prompt_tokens"] + N
    assert "cached_tokens" in usage["prompt_tokens_details"]


def test_chat_events_with_usage(server):
    response, raw = stream(
        server, "/v1/chat/completions", chat_body(stream_options={"include_usage": True})
    )
    check_headers(response)
    payloads = sse_payloads(raw)
    first, *content, last = payloads
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert first["choices"][0]["finish_reason"] is None
    assert 1 <= len(content) <= N  # as for completions
    for chunk in [first, *content]:
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk.get("usage") is None
        (choice,) = chunk["choices"]
        assert choice["index"] == 0
    assert all("role" not in c["choices"][0]["delta"] for c in content)
    assert all(isinstance(c["choices"][0]["delta"]["content"], str) for c in content)
    reasons = [c["choices"][0]["finish_reason"] for c in content]
    assert reasons == [None] * (len(reasons) - 1) + ["length"]
    assert len({c["id"] for c in payloads}) == 1
    assert last["choices"] == []
    usage = last["usage"]
    assert usage["completion_tokens"] == N
    assert usage["prompt_tokens"] == len(tokenize(server, messages=MESSAGES))
    assert usage["total_tokens"] == usage["prompt_tokens"] + N


@pytest.mark.parametrize("options", [None, {"include_usage": False}], ids=["absent", "false"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_no_usage_chunk_without_include_usage(server, path, options):
    body = completion_body() if path == "/v1/completions" else chat_body()
    if options is not None:
        body["stream_options"] = options
    response, raw = stream(server, path, body)
    check_headers(response)
    payloads = sse_payloads(raw)
    assert payloads
    assert all(chunk["choices"] for chunk in payloads)
    assert all(chunk.get("usage") is None for chunk in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_several_prompts_in_one_stream(server):
    prompts = [PROMPT, "Call me Ishmael."]
    body = completion_body(prompt=prompts, stream_options={"include_usage": True})
    response, raw = stream(server, "/v1/completions", body)
    check_headers(response)
    *content, last = sse_payloads(raw)
    per_index = {0: 0, 1: 0}
    for chunk in content:
        (choice,) = chunk["choices"]
        per_index[choice["index"]] += 1
    assert all(1 <= count <= N for count in per_index.values()), per_index  # see above
    assert last["usage"]["completion_tokens"] == 2 * N
    assert last["usage"]["prompt_tokens"] == sum(len(tokenize(server, prompt=p)) for p in prompts)


def test_stream_stopped_by_a_stop_string(server):
    whole = httpx.post(
        server.url + "/v1/completions", json=completion_body(stream=False, max_tokens=12)
    ).json()
    text = whole["choices"][0]["text"]
    stop = text[-3:]
    response, raw = stream(
        server, "/v1/completions", completion_body(max_tokens=12, stop=[stop, "never-seen"])
    )
    check_headers(response)
    payloads = sse_payloads(raw)
    assert "".join(c["choices"][0]["text"] for c in payloads) == text[: text.index(stop)]
    assert payloads[-1]["choices"][0]["finish_reason"] == "stop"
    assert payloads[-1]["choices"][0]["stop_reason"] == stop


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_invalid_stream_request_is_a_json_error_not_a_stream(server, path):
    body = completion_body() if path == "/v1/completions" else chat_body()
    response, raw = stream(server, path, body | {"temperature": -1})
    assert_error(response, 400, param="temperature")
    assert b"data:" not in raw
