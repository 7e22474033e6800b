"""vLLM's tests/entrypoints/openai/basic/test_basic.py: /version, /health, cancellation under a
burst of abandoned requests, and a body that is not JSON."""

from __future__ import annotations

import asyncio
from importlib.metadata import version

import httpx
import openai
import pytest


def test_show_version(server):
    """test_show_version: /version answers {"version": <the server's version>}."""
    response = httpx.get(server.url + "/version", timeout=10)
    assert response.status_code == 200
    assert response.json() == {"version": version("pegainfer-server")}


def test_check_health(server):
    """test_check_health: /health is 200 once the model is loaded."""
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_request_cancellation(server):
    """test_request_cancellation: clients that give up on long generations (min_tokens =
    max_tokens, far past their timeout) leave no work behind; a request then answers well
    within a short timeout."""
    messages = [{"role": "user", "content": "Write a long story"}]

    async def burst() -> list[BaseException | None]:
        async with openai.AsyncOpenAI(
            base_url=server.base_url, api_key="unused", max_retries=0, timeout=0.5
        ) as client:
            tasks = [
                client.chat.completions.create(
                    model=server.model,
                    messages=messages,
                    max_tokens=400,
                    extra_body={"min_tokens": 400},
                )
                for _ in range(16)
            ]
            return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(burst())
    assert all(isinstance(result, openai.APITimeoutError) for result in results), results
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=10)
    reply = client.chat.completions.create(model=server.model, messages=messages, max_tokens=10)
    assert len(reply.choices) == 1


def test_request_wrong_content_type(client, server):
    """test_request_wrong_content_type: a form-encoded body is refused with an error status."""
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Write a long story"}],
            max_tokens=10, extra_headers={"Content-Type": "application/x-www-form-urlencoded"},
        )  # fmt: skip
    assert 400 <= refused.value.status_code < 500
