"""Requests waiting for a preparation thread are bounded: each holds a waiting slot (and its
body, up to 32 MiB) until it is prepared, and past `--max-waiting-requests` a request is
refused with the full queue's 503 and Retry-After instead of queueing without bound."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx

from pegainfer.core.engine.engine_config import EngineConfig
from pegainfer.core.engine.frontend import Frontend
from pegainfer.core.engine.metrics import Metrics
from pegainfer.core.text.tokenizer import Tokenizer
from pegainfer.server import app as app_module
from pegainfer.server.app import ServerState, build_app
from pegainfer.server.engine_client import AsyncEngineClient
from tests.server.helpers import assert_error
from tests.server.test_health import SilentEngine

SLOTS = 3


def test_requests_past_the_waiting_slots_are_refused_while_others_are_prepared(
    tiny_model, monkeypatch
):
    model_config = json.loads((tiny_model / "config.json").read_text())
    config = EngineConfig(tiny_model, tiny_model, model_config, "qwen3", "cpu",
                          "float32", 512, 16, 64, model_config["vocab_size"])  # fmt: skip
    frontend = Frontend(tiny_model, Tokenizer.from_dir(tiny_model))
    # /tokenize's preparation waits at a gate: the stand-in for a slow one (a 10 MB prompt).
    gate = threading.Event()
    tokenized = app_module.tokenized

    def slow_tokenized(*args, **kwargs):
        assert gate.wait(60), "the test never opened the gate"
        return tokenized(*args, **kwargs)

    monkeypatch.setattr(app_module, "tokenized", slow_tokenized)

    async def scenario() -> None:
        client = AsyncEngineClient(SilentEngine(config), frontend, Metrics("m"), SLOTS)
        state = ServerState(model_names=["m"], client=client)
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            held = [asyncio.create_task(http.post("/tokenize", json={"prompt": f"slow {i}"}))
                    for i in range(SLOTS)]  # fmt: skip
            # Every slot is held by a request being prepared (some only queued for a thread).
            while client.slots_held < SLOTS:
                await asyncio.sleep(0.01)
            refused = [
                await http.post("/tokenize", json={"prompt": "one more"}),
                await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}),
                await http.post("/v1/completions",
                                json={"prompt": "hi", "max_tokens": 1, "stream": True}),
                await http.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
            ]  # fmt: skip
            for response in refused:
                assert_error(response, 503, contains="server busy")
                assert response.json()["error"]["code"] == "server_busy"
                assert response.headers["Retry-After"] == "1"
            assert (await http.get("/health")).status_code == 200  # full, not stalled
            gate.set()
            for response in await asyncio.gather(*held):
                assert response.status_code == 200, response.text
            # Their slots came back.
            assert (await http.post("/tokenize", json={"prompt": "after"})).status_code == 200
            assert client.slots_held == 0
        client.close()

    try:
        asyncio.run(scenario())
    finally:
        gate.set()
