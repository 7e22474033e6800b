"""`EngineProcess`: the engine loop in a process of its own, driven through the same messages
as the thread-mode loop."""

from __future__ import annotations

import json
import logging
import queue

import pytest

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.engine.loop import decode_outputs
from pegainfer.core.engine.messages import EngineRequest
from pegainfer.core.engine.process import EngineProcess, EngineStartError
from pegainfer.core.errors import ModelLineError
from pegainfer.core.sampling.sampling_params import SamplingParams
from pegainfer.models.qwen3.line import Qwen3Line
from pegainfer.server.bench.startup import phases
from tests.engine_harness import generate, greedy

DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine-process")
    Qwen3Line().write_tiny_checkpoint(path, seed=11)
    return path


def engine_args(model) -> EngineArgs:
    return EngineArgs(model=str(model), device="cpu", max_model_len=256, block_size=8)


def request(rid: str, prompt: list[int], params: SamplingParams) -> EngineRequest:
    return EngineRequest(
        request_id=rid, prompt_token_ids=prompt, params=params, eos_token_ids=[], arrival_time=0
    )


def test_the_engine_process_generates_what_the_engine_does(model_dir):
    prompts = [[1, 2, 3], list(range(30)), [9] * 5]
    engine = EngineCore(engine_args(model_dir))
    expected = generate(engine, prompts, greedy(10))
    process = EngineProcess.spawn(engine_args(model_dir))
    try:
        assert process.wait_ready() == engine.config
        outputs: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        process.start(outputs.put)
        for i, prompt in enumerate(prompts):
            process.send(request(str(i), prompt, greedy(10)))
        tokens: dict[str, list[int]] = {}
        finished: set[str] = set()
        while len(finished) < len(prompts):
            batch = decode_outputs(outputs.get(timeout=DEADLINE_S))
            assert batch.engine_failed is None
            for output in batch.outputs:
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
                if output.finished:
                    finished.add(output.request_id)
        assert [tokens[str(i)] for i in range(len(prompts))] == expected
        assert process.alive
    finally:
        process.shutdown()
    assert process.process.exitcode == 0
    assert not process.alive


def test_a_load_error_reaches_the_frontend_with_its_text(model_dir, tmp_path):
    """The engine process's start-up error is raised with the text the engine gave."""
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    with pytest.raises(ModelLineError) as in_process:
        EngineCore(engine_args(bad))
    process = EngineProcess.spawn(engine_args(bad))
    with pytest.raises(EngineStartError) as remote:
        process.wait_ready()
    assert str(remote.value) == str(in_process.value)
    assert process.process.exitcode == 1
    assert not process.alive


def test_a_dead_engine_process_fails_the_requests_in_flight(model_dir):
    process = EngineProcess.spawn(engine_args(model_dir))
    try:
        process.wait_ready()
        outputs: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        process.start(outputs.put)
        process.send(request("a", [1, 2], greedy(200)))
        assert decode_outputs(outputs.get(timeout=DEADLINE_S)).outputs  # it is running
        process.process.kill()
        while (batch := decode_outputs(outputs.get(timeout=DEADLINE_S))).engine_failed is None:
            pass
        assert batch.engine_failed == "the engine process was killed by signal SIGKILL"
        assert not process.alive
    finally:
        process.shutdown()


def test_the_engine_process_logs_its_start_from_its_first_line(model_dir, caplog, capfd):
    """Its start-up log covers the process from its first line: the phases before the engine
    loads (the imports) come first, in order, as `pegainfer-bench startup` reads them."""
    caplog.set_level(logging.INFO)  # the engine process logs at this process's level
    process = EngineProcess.spawn(engine_args(model_dir))
    try:
        process.wait_ready()
    finally:
        process.shutdown()
    logged = phases(capfd.readouterr().err)
    names = [phase["phase"] for phase in logged]
    first = ["engine process started", "torch imported", "engine imported", "model loaded"]
    assert [name for name in names if name in first] == first, names
    assert names[-1] == "engine ready"
    seconds = [phase["s"] for phase in logged]
    assert seconds == sorted(seconds)
    assert 0 < seconds[0] < seconds[-1]
