"""A request's grammar compiles once, in the engine (issue 28 item 26; issue 21: the HTTP
process never builds llguidance's view of the tokenizer): the server asks the engine for a
verdict before the request is sent (a bad grammar is still a refusal before any output), and a
server whose engine cannot answer fails the wait instead of hanging a frontend thread."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import pytest

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.engine.engine_config import EngineConfig
from pegainfer.core.engine.frontend import Frontend
from pegainfer.core.engine.loop import EngineLoop, encode
from pegainfer.core.engine.messages import EngineOutputs
from pegainfer.core.engine.metrics import Metrics
from pegainfer.core.errors import InvalidRequestError
from pegainfer.core.sampling.sampling_params import SamplingParams
from pegainfer.core.sampling.structured_output import Grammars, StructuredOutput
from pegainfer.core.text.tokenizer import Tokenizer
from pegainfer.server.engine_client import AsyncEngineClient, EngineFailedError, ShuttingDownError
from tests.server.test_health import SilentEngine

REGEX = StructuredOutput(kind="regex", spec="[ab]{3}")


@pytest.fixture
def compiles(monkeypatch) -> list[str]:
    """The thread of every grammar compile against the tokenizer, in any process' Grammars."""
    threads: list[str] = []
    real = Grammars._compile

    def counted(self, *args):
        threads.append(threading.current_thread().name)
        return real(self, *args)

    monkeypatch.setattr(Grammars, "_compile", counted)
    return threads


def test_a_grammar_compiles_once_in_the_engine_off_its_step_loop(tiny_model, compiles):
    engine_loop = EngineLoop(EngineCore(EngineArgs(model=str(tiny_model), device="cpu",
                                                   max_model_len=256)))  # fmt: skip
    frontend = Frontend.for_engine(engine_loop.config)

    async def scenario() -> list[str]:
        client = AsyncEngineClient(engine_loop, frontend, Metrics("m"), 8)
        texts = []
        try:
            for i in range(2):  # the second request meets the compiled grammar
                params = SamplingParams(temperature=0.8, seed=i, max_tokens=8, structured=REGEX)
                request = frontend.make_request(f"r{i}", [1, 2, 3], params)
                await client.run_frontend(client.limits.check, request)
                async for stream, _ in client.generate(request, client.reserve(1)):
                    text = stream.text
                texts.append(text)
        finally:
            client.close()
            engine_loop.shutdown()
        return texts

    for text in asyncio.run(scenario()):
        assert re.fullmatch("[ab]{3}", text), text
    assert len(compiles) == 1, compiles
    assert compiles[0].startswith("pegainfer-grammar"), compiles


def test_a_grammar_the_engine_cannot_compile_is_refused_before_it_is_sent(tiny_model):
    engine_loop = EngineLoop(EngineCore(EngineArgs(model=str(tiny_model), device="cpu",
                                                   max_model_len=256)))  # fmt: skip
    frontend = Frontend.for_engine(engine_loop.config)
    # Valid without the tokenizer; fails on its first mask (a schema that only refers to itself).
    looping = StructuredOutput.json_schema({"$ref": "#"})

    async def scenario() -> None:
        client = AsyncEngineClient(engine_loop, frontend, Metrics("m"), 8)
        try:
            request = frontend.make_request("r", [1, 2, 3], SamplingParams(structured=looping))
            with pytest.raises(InvalidRequestError) as refused:
                await client.run_frontend(client.limits.check, request)
            assert refused.value.param == "json_schema"
            assert client.num_in_flight == 0
        finally:
            client.close()
            engine_loop.shutdown()

    asyncio.run(scenario())


@pytest.fixture
def silent(tiny_model) -> tuple[SilentEngine, Frontend]:
    model_config = json.loads((tiny_model / "config.json").read_text())
    config = EngineConfig(tiny_model, tiny_model, model_config, "qwen3", "cpu",
                          "float32", 512, 16, 64, model_config["vocab_size"])  # fmt: skip
    return SilentEngine(config), Frontend(tiny_model, Tokenizer.from_dir(tiny_model))


def test_a_waiting_check_fails_when_the_engine_fails(silent):
    engine, frontend = silent

    async def scenario() -> None:
        client = AsyncEngineClient(engine, frontend, Metrics("m"), 8)
        sink = client._on_outputs
        waiting = asyncio.ensure_future(client.run_frontend(client.check_grammar, REGEX, [0]))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # the engine has not answered
        sink(encode(EngineOutputs([], engine_failed="engine failure: boom")))
        with pytest.raises(EngineFailedError, match="boom"):
            await asyncio.wait_for(waiting, 30)
        with pytest.raises(EngineFailedError, match="boom"):  # and at once from then on
            client.check_grammar(REGEX, [0])
        client.close()

    asyncio.run(scenario())


def test_closing_the_client_ends_a_waiting_check(silent):
    engine, frontend = silent

    async def scenario() -> None:
        client = AsyncEngineClient(engine, frontend, Metrics("m"), 8)
        waiting = asyncio.ensure_future(client.run_frontend(client.check_grammar, REGEX, [0]))
        await asyncio.sleep(0.2)
        client.close()
        with pytest.raises(ShuttingDownError):
            await asyncio.wait_for(waiting, 30)

    asyncio.run(scenario())
