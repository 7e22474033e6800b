"""The engine loop in its thread, driven only through encoded messages."""

from __future__ import annotations

import queue

import pytest

from pegainfer.core.engine.loop import EngineLoop, decode_outputs
from pegainfer.core.engine.messages import AbortRequest, EngineRequest
from pegainfer.core.sampling.sampling_params import SamplingParams
from pegainfer.core.text.tokenizer import Tokenizer
from tests.engine_harness import generate, greedy, make_engine


def request(rid: str, prompt: list[int], params: SamplingParams) -> EngineRequest:
    return EngineRequest(
        request_id=rid, prompt_token_ids=prompt, params=params, eos_token_ids=[], arrival_time=0
    )


@pytest.fixture
def loop(hf_checkpoints):
    outputs: queue.SimpleQueue[bytes] = queue.SimpleQueue()
    engine_loop = EngineLoop(make_engine(hf_checkpoints(True)))
    engine_loop.start(outputs.put)
    yield engine_loop, outputs
    engine_loop.shutdown()
    assert not engine_loop.alive


def collect(outputs: queue.SimpleQueue, expect: set[str]) -> dict[str, tuple[list[int], str]]:
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    while set(reasons) != expect:
        for out in decode_outputs(outputs.get(timeout=30)).outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason:
                reasons[out.request_id] = out.error or out.finish_reason
    return {rid: (tokens[rid], reasons[rid]) for rid in expect}


def test_loop_generates_like_the_engine(loop, hf_checkpoints):
    engine_loop, outputs = loop
    prompts = [[1, 2, 3], list(range(40)), [7] * 9]
    for i, prompt in enumerate(prompts):
        engine_loop.send(request(str(i), prompt, greedy(12)))
    got = collect(outputs, {"0", "1", "2"})
    expected = generate(make_engine(hf_checkpoints(True)), prompts, greedy(12))
    assert [got[str(i)] for i in range(3)] == [(e, "length") for e in expected]


def test_abort_and_bad_request_do_not_disturb_others(loop):
    engine_loop, outputs = loop
    engine_loop.send(request("long", [5, 6, 7], greedy(400)))
    engine_loop.send(request("bad", [1, 2], SamplingParams(top_p=0.0)))
    engine_loop.send(request("ok", [8, 9], greedy(5)))
    engine_loop.send(AbortRequest(["long"]))
    got = collect(outputs, {"long", "bad", "ok"})
    assert got["long"][1] == "abort" and len(got["long"][0]) < 400
    assert "top_p" in got["bad"][1]
    assert got["ok"] == (got["ok"][0], "length") and len(got["ok"][0]) == 5
    assert engine_loop.engine.block_manager.usage == 0.0


def test_a_failing_step_ends_every_request_in_flight(hf_checkpoints):
    """Requests running, and requests still in the inbox, all end with the failure."""
    import asyncio

    import pytest

    from pegainfer.core.engine.frontend import Frontend
    from pegainfer.core.engine.metrics import Metrics
    from pegainfer.models.qwen3.line import Qwen3Line
    from pegainfer.server.engine_client import AsyncEngineClient, EngineFailedError

    engine = make_engine(hf_checkpoints(True))
    calls = {"n": 0}
    real_step = engine.step

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return real_step()

    engine.step = failing_step

    async def scenario(tmp_tokenizer_dir):
        client = AsyncEngineClient(
            EngineLoop(engine),
            Frontend(tmp_tokenizer_dir, Tokenizer.from_dir(tmp_tokenizer_dir)),
            Metrics("m"),
            100,
        )
        reservation = client.reserve(2)

        async def consume(rid):
            req = client.frontend.make_request(rid, [1, 2, 3], greedy(50))
            async for _ in client.generate(req, reservation):
                pass

        results = await asyncio.wait_for(
            asyncio.gather(consume("a"), consume("b"), return_exceptions=True), timeout=30
        )
        assert all(isinstance(r, EngineFailedError) for r in results), results
        assert "device lost" in str(results[0])
        assert not client.alive
        with pytest.raises(EngineFailedError):
            client.reserve(1)

    tokenizer_dir = hf_checkpoints(True).parent / "tok"
    if not (tokenizer_dir / "tokenizer.json").exists():
        Qwen3Line().write_tiny_checkpoint(tokenizer_dir, num_hidden_layers=1)
    asyncio.run(scenario(tokenizer_dir))
