"""`/health` reports a server that cannot admit work (issue 28, item 17): every waiting slot
held with none given back for a while (an engine that stopped admitting, slots leaked) is a
503 saying so; a server full for a moment, or one whose slots come back, stays 200."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pegainfer.core.engine.engine_config import EngineConfig
from pegainfer.core.engine.frontend import Frontend
from pegainfer.core.engine.loop import OutputSink
from pegainfer.core.engine.messages import Inbound
from pegainfer.core.engine.metrics import Metrics
from pegainfer.core.sampling.sampling_params import SamplingParams
from pegainfer.core.text.tokenizer import Tokenizer
from pegainfer.server import engine_client
from pegainfer.server.app import ServerState, build_app
from pegainfer.server.engine_client import AsyncEngineClient

SLOTS = 2
STALLED_S = 0.5


class SilentEngine:
    """An `EngineConnection` that takes requests and never admits them."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.alive = True

    def start(self, sink: OutputSink) -> None:
        pass

    def send(self, message: Inbound) -> None:
        pass

    def shutdown(self, timeout: float | None = 30.0) -> None:
        self.alive = False


@pytest.fixture
def stall_after(monkeypatch) -> float:
    monkeypatch.setattr(engine_client, "_STALLED_S", STALLED_S)
    return STALLED_S


def test_health_turns_503_when_no_waiting_slot_comes_back(tiny_model, stall_after):
    model_config = json.loads((tiny_model / "config.json").read_text())
    config = EngineConfig(tiny_model, tiny_model, model_config, "qwen3", "cpu",
                          "float32", 512, 16, 64, model_config["vocab_size"])  # fmt: skip
    frontend = Frontend(tiny_model, Tokenizer.from_dir(tiny_model))

    async def scenario() -> None:
        client = AsyncEngineClient(SilentEngine(config), frontend, Metrics("m"), SLOTS)
        state = ServerState(model_names=["m"], client=client)
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:

            async def health() -> httpx.Response:
                return await http.get("/health")

            ids = frontend.tokenizer.encode("Say", False)
            params = SamplingParams(max_tokens=4)

            async def wait_forever(i: int) -> None:
                request = frontend.make_request(f"r{i}", ids, params)
                async for _ in client.generate(request, client.reserve(1)):
                    pass

            waiting = [asyncio.create_task(wait_forever(i)) for i in range(SLOTS)]
            await asyncio.sleep(0)  # both requests sent: every slot held
            assert (await health()).status_code == 200  # full for a moment only
            await asyncio.sleep(stall_after * 1.5)
            stalled = await health()
            assert stalled.status_code == 503
            assert f"all {SLOTS} waiting slots held" in stalled.text
            # A slot given back (its client went away) makes the server able to admit again.
            waiting[0].cancel()
            await asyncio.gather(waiting[0], return_exceptions=True)
            assert (await health()).status_code == 200
            waiting[1].cancel()
            await asyncio.gather(waiting[1], return_exceptions=True)
        client.close()

    asyncio.run(scenario())
