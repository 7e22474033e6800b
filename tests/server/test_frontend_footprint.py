"""The server's HTTP process stays small, at rest and under load (issue 21): it never imports
torch, transformers, Triton or FlashInfer (only the engine process runs the model), whatever
the requests ask for: streams, chat templates, tool calls, grammars, logprobs, tokenizing,
metrics. With torch it held ~250 MiB here (~480-610 MiB with CUDA's); without, ~50-60 MiB."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pegainfer.core.process_info import rss_bytes
from tests.server.conftest import Server, start_server, stop_server
from tests.server.import_guard import HEAVY, REPORT

# torch alone adds ~210 MiB (the CPU wheel) to a process; the HTTP process holds ~50-60 MiB
# here (Python, starlette and hypercorn, the tokenizer; grammars compile in the engine).
_HTTP_RSS_BOUND = 200 << 20

_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def guarded_server(tiny_model, tmp_path_factory) -> Iterator[Server]:
    """The tiny model's server (engine in its own process) with its HTTP process's heavy
    imports reported, after a mixed load of every kind of request."""
    log = tmp_path_factory.mktemp("footprint") / "server.log"
    guard = (sys.executable, str(Path(__file__).with_name("import_guard.py")))
    server = start_server(tiny_model, log, "--device", "cpu", command=guard)
    try:
        asyncio.run(_load(server))
        yield server
    finally:
        stop_server(server)


async def _load(server: Server) -> None:
    chat = server.base_url + "/chat/completions"
    completions = server.base_url + "/completions"
    user = [{"role": "user", "content": "What is the weather in Paris?"}]
    model = {"model": server.model, "max_tokens": 12}
    bodies = [
        (completions, model | {"prompt": "Hello there", "stream": True, "logprobs": 3}),
        (completions, model | {"prompt": [1, 2, 3], "n": 2, "temperature": 0.8, "seed": 1}),
        (chat, model | {"messages": user, "stream": True,
                        "stream_options": {"include_usage": True}}),
        (chat, model | {"messages": user, "tools": _TOOLS, "stream": True}),
        (chat, model | {"messages": user, "tools": _TOOLS, "tool_choice": "required"}),
        (chat, model | {"messages": user, "max_tokens": 24, "response_format": {
            "type": "json_schema", "json_schema": {"name": "answer", "schema": _SCHEMA}}}),
        (chat, model | {"messages": user, "logprobs": True, "top_logprobs": 2}),
        (completions, model | {"prompt": "a", "structured_outputs": {"regex": "[a-c]{3}"}}),
        (server.url + "/tokenize", {"model": server.model, "messages": user}),
        (server.url + "/detokenize", {"model": server.model, "tokens": [1, 2, 3]}),
    ]  # fmt: skip
    async with httpx.AsyncClient(timeout=120) as client:
        for _ in range(2):  # twice: the second round meets the cached grammars and prefixes
            replies = await asyncio.gather(
                *(client.post(url, json=body) for url, body in bodies),
                client.get(server.url + "/metrics"),
                client.get(server.base_url + "/models"),
            )
            for reply in replies:
                assert reply.status_code == 200, reply.text


def test_the_http_process_never_imports_torch(guarded_server):
    logs = guarded_server.logs()
    assert REPORT not in logs, logs[logs.index(REPORT) :][:3000]
    mapped = Path(f"/proc/{guarded_server.process.pid}/maps").read_text()
    libraries = [name for name in HEAVY if f"/{name}/" in mapped or f"lib{name}" in mapped]
    assert not libraries, f"the HTTP process maps {libraries}'s files"


def test_the_http_process_stays_small_under_load(guarded_server):
    time.sleep(0.5)  # the last responses' buffers go
    resident = rss_bytes(guarded_server.process.pid)
    assert 0 < resident < _HTTP_RSS_BOUND, f"HTTP process: {resident >> 20} MiB resident"
