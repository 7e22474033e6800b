"""A stream whose consumer is behind gets the outputs queued meanwhile as one delta (one SSE
event), with the text, tokens, logprobs and finish exactly as one delta per output gives."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from pegainfer.core.engine.engine_config import EngineConfig
from pegainfer.core.engine.frontend import Frontend, RequestStream, StreamDelta
from pegainfer.core.engine.loop import OutputSink, encode
from pegainfer.core.engine.messages import (
    EngineOutputs,
    EngineRequest,
    Inbound,
    RequestOutput,
    TokenLogprob,
)
from pegainfer.core.engine.metrics import Metrics
from pegainfer.core.sampling.sampling_params import SamplingParams
from pegainfer.core.text.tokenizer import Tokenizer
from pegainfer.server.engine_client import AsyncEngineClient, EngineFailedError

TEXT = "Hello world, here is some text STOP and more after it"


class ScriptedEngine:
    """An `EngineConnection` that answers each request with `script` all at once, so every
    output is queued before the request's consumer runs: a consumer behind."""

    def __init__(self, config: EngineConfig, script: list[RequestOutput]) -> None:
        self.config = config
        self.script = script
        self.alive = True
        self._sink: OutputSink | None = None

    def start(self, sink: OutputSink) -> None:
        self._sink = sink

    def send(self, message: Inbound) -> None:
        if isinstance(message, EngineRequest):
            assert self._sink is not None
            for output in self.script:
                output = msgspec.structs.replace(output, request_id=message.request_id)
                self._sink(encode(EngineOutputs([output])))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        self.alive = False


@pytest.fixture(scope="module")
def frontend(tiny_model) -> Frontend:
    return Frontend(tiny_model, Tokenizer.from_dir(tiny_model))


@pytest.fixture(scope="module")
def engine_config(tiny_model) -> EngineConfig:
    model_config = json.loads((tiny_model / "config.json").read_text())
    return EngineConfig(tiny_model, tiny_model, model_config, "qwen3", "cpu",
                        "float32", 512, 16, 64, model_config["vocab_size"])  # fmt: skip


def token_outputs(frontend: Frontend) -> list[RequestOutput]:
    """One output per token of TEXT, each with its logprob; the last ends by length."""
    ids = frontend.tokenizer.encode(TEXT, False)
    outputs = [
        RequestOutput(request_id="", new_token_ids=[t], num_cached_tokens=0,
                      logprobs=[TokenLogprob(t, -0.01 * i, 1, [(t, -0.01 * i)])])
        for i, t in enumerate(ids)
    ]  # fmt: skip
    outputs[-1].finish_reason = "length"
    return outputs


def params() -> SamplingParams:
    return SamplingParams(max_tokens=100, stop=["STOP"], logprobs=1)


def stream(
    frontend: Frontend, engine_config: EngineConfig, script: list[RequestOutput]
) -> tuple[list[StreamDelta], EngineFailedError | None]:
    """The deltas a client yields for one request the engine answers with `script` at once,
    and the error that ended them, if any."""

    async def scenario() -> tuple[list[StreamDelta], EngineFailedError | None]:
        client = AsyncEngineClient(ScriptedEngine(engine_config, script), frontend,
                                   Metrics("m"), 10)  # fmt: skip
        request = frontend.make_request("x", frontend.tokenizer.encode("Say", False), params())
        got: list[StreamDelta] = []
        try:
            async for _, delta in client.generate(request, client.reserve(1)):
                got.append(delta)
        except EngineFailedError as exc:
            return got, exc
        return got, None

    return asyncio.run(scenario())


def test_a_consumer_behind_gets_one_delta_identical_to_the_per_token_ones(frontend, engine_config):
    script = token_outputs(frontend)
    prompt = frontend.tokenizer.encode("Say", False)
    one_by_one = RequestStream("x", prompt, params(), frontend.tokenizer)
    per_token = [one_by_one.process(output) for output in script]
    (delta,), error = stream(frontend, engine_config, script)
    assert error is None
    assert delta.text == "".join(d.text for d in per_token) == one_by_one.text
    assert delta.text.endswith("some text ") and "after" not in delta.text  # stopped at STOP
    assert delta.token_ids == one_by_one.token_ids  # not the tokens after the stop string
    assert delta.logprobs == one_by_one.logprobs
    assert (delta.finished, delta.finish_reason, delta.stop_reason) == (True, "stop", "STOP")
    assert delta.abort_engine  # the engine still runs the request: the stop string ended it


def test_tokens_queued_before_an_engine_failure_go_out_before_the_error(frontend, engine_config):
    script = [*token_outputs(frontend)[:3], RequestOutput.failure("", "engine failure: boom")]
    got, error = stream(frontend, engine_config, script)
    assert len(got) == 1 and got[0].token_ids == [o.new_token_ids[0] for o in script[:3]]
    assert isinstance(error, EngineFailedError) and "boom" in str(error)


class _BrokenPipe(ScriptedEngine):
    """A connection whose send fails, as a dead engine process's pipe does."""

    def send(self, message: Inbound) -> None:
        raise BrokenPipeError("the engine process is gone")


def test_a_request_whose_send_fails_gives_its_waiting_slot_back(frontend, engine_config):
    async def scenario() -> AsyncEngineClient:
        client = AsyncEngineClient(_BrokenPipe(engine_config, []), frontend, Metrics("m"), 1)
        request = frontend.make_request("x", frontend.tokenizer.encode("Say", False), params())
        with pytest.raises(BrokenPipeError):
            async for _ in client.generate(request, client.reserve(1)):
                pass
        client.reserve(1)  # the one waiting slot is free again (ServerBusyError otherwise)
        return client

    asyncio.run(scenario())
