"""The engine loop compiles a request's grammar on its pool and schedules the request once the
grammar is ready: a slow compile never holds up the other requests' steps."""

from __future__ import annotations

import queue
import threading

import pytest

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.engine.loop import EngineLoop, decode_outputs
from pegainfer.core.engine.messages import AbortRequest, EngineRequest, RequestOutput
from pegainfer.core.sampling.sampling_params import SamplingParams
from pegainfer.core.sampling.structured_output import Grammars, StructuredOutput
from pegainfer.core.text.tokenizer import Tokenizer
from pegainfer.models.qwen3.line import Qwen3Line
from tests.engine_harness import greedy

DEADLINE_S = 60.0
SCHEMA = StructuredOutput.json_schema(
    {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
     "additionalProperties": False}
)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("loop-grammars")
    Qwen3Line().write_tiny_checkpoint(path, seed=7)
    return path


@pytest.fixture
def compiles(monkeypatch):
    """Every grammar compile waits for `release` and records the thread it ran on."""
    release = threading.Event()
    threads: list[str] = []
    real = Grammars._compile

    def gated(self, *args):
        threads.append(threading.current_thread().name)
        assert release.wait(DEADLINE_S)
        return real(self, *args)

    monkeypatch.setattr(Grammars, "_compile", gated)
    return release, threads


@pytest.fixture
def loop(model_dir):
    engine_loop = EngineLoop(EngineCore(EngineArgs(model=str(model_dir), device="cpu",
                                                   max_model_len=256)))  # fmt: skip
    outputs: queue.SimpleQueue[bytes] = queue.SimpleQueue()
    engine_loop.start(outputs.put)
    yield engine_loop, outputs
    engine_loop.shutdown()


def constrained(model_dir, rid: str, structured: StructuredOutput) -> EngineRequest:
    eos = Tokenizer.from_dir(model_dir).eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=40, structured=structured)
    return EngineRequest(request_id=rid, prompt_token_ids=[1, 2, 3], params=params,
                         eos_token_ids=[eos], arrival_time=0)  # fmt: skip


def free(rid: str) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=[4, 5, 6], params=greedy(12),
                         eos_token_ids=[], arrival_time=0)  # fmt: skip


def until_finished(outputs: queue.SimpleQueue, *rids: str) -> list[RequestOutput]:
    """Every output until each of `rids` has finished, whichever request each is for."""
    seen: list[RequestOutput] = []
    while not set(rids) <= {o.request_id for o in seen if o.finished}:
        seen += decode_outputs(outputs.get(timeout=DEADLINE_S)).outputs
    return seen


def test_a_compiling_grammar_does_not_hold_up_other_requests(model_dir, loop, compiles):
    engine_loop, outputs = loop
    release, threads = compiles
    engine_loop.send(constrained(model_dir, "json", SCHEMA))
    engine_loop.send(free("free"))
    seen = until_finished(outputs, "free")
    assert sum(len(o.new_token_ids) for o in seen if o.request_id == "free") == 12
    assert not [o for o in seen if o.request_id == "json"]  # still compiling
    release.set()
    json_out = [o for o in until_finished(outputs, "json") if o.request_id == "json"]
    assert json_out[-1].finish_reason in ("stop", "length") and json_out[-1].error is None
    # One compile for the request (check_request and add_request took copies), on the pool.
    assert len(threads) == 1 and threads[0].startswith("pegainfer-grammar")


def test_a_grammar_that_does_not_compile_fails_only_its_request(model_dir, loop):
    engine_loop, outputs = loop
    engine_loop.send(constrained(model_dir, "bad", StructuredOutput.json_schema({"type": "x"})))
    engine_loop.send(free("free"))
    seen = until_finished(outputs, "free", "bad")
    assert sum(len(o.new_token_ids) for o in seen if o.request_id == "free") == 12
    (bad,) = [o for o in seen if o.request_id == "bad"]
    assert bad.finish_reason == "error" and "invalid json_schema" in bad.error


def test_aborting_a_request_while_its_grammar_compiles_ends_it(model_dir, loop, compiles):
    engine_loop, outputs = loop
    release, _ = compiles
    engine_loop.send(constrained(model_dir, "json", SCHEMA))
    engine_loop.send(AbortRequest(["json"]))
    (aborted,) = until_finished(outputs, "json")
    assert aborted.finish_reason == "abort"
    release.set()
    engine_loop.send(free("after"))
    seen = until_finished(outputs, "after")
    assert not [o for o in seen if o.request_id == "json"]
    assert not engine_loop.engine.requests  # the compiled request was never admitted
