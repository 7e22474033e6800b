"""vLLM's tests/entrypoints/openai/chat_completion/test_non_object_body_validation.py over
HTTP: a body that is not a JSON object is a 400, never a 500; cache_salt is still checked."""

from __future__ import annotations

import httpx
import pytest

from tests.server.helpers import assert_error


@pytest.mark.parametrize(
    "body", [b"this is not valid json{{{", b'["not", "an", "object"]', b"42", b"null"]
)
def test_chat_completion_request_rejects_non_object_body(server, body):
    """test_chat_completion_request_rejects_non_object_body: an OpenAI-shaped 400."""
    response = httpx.post(server.url + "/v1/chat/completions", content=body, timeout=30,
                          headers={"content-type": "application/json"})  # fmt: skip
    assert_error(response, 400)


def test_chat_completion_request_cache_salt_still_validated_on_dict(server):
    """test_chat_completion_request_cache_salt_still_validated_on_dict: an empty cache_salt is
    a 400 naming it."""
    body = {"model": server.model, "messages": [{"role": "user", "content": "hello"}],
            "cache_salt": ""}  # fmt: skip
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert_error(response, 400, contains="cache_salt")
