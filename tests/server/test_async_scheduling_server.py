"""The server with --no-async-scheduling (step by step) answers concurrent streams as the
default (async) server does."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.server.conftest import start_server, stop_server


@pytest.fixture(scope="module")
def stepwise_server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("stepwise-log") / "server.log"
    running = start_server(tiny_model, log, "--max-model-len", "512", "--no-async-scheduling")
    yield running
    stop_server(running)


def completions(server, prompts: list[str]) -> list[str]:
    client = openai.OpenAI(base_url=server.base_url, api_key="none")

    def one(prompt: str) -> str:
        stream = client.completions.create(model=server.model, prompt=prompt, max_tokens=20,
                                           temperature=0, stream=True)  # fmt: skip
        return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, prompts))


def test_concurrent_streams_match_the_default_server(server, stepwise_server):
    prompts = [f"Request number {i} asks about {'blocks ' * i}" for i in range(8)]
    assert completions(stepwise_server, prompts) == completions(server, prompts)
