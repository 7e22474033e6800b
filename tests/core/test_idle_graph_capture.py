"""An idle engine loop captures the decode graphs its engine still misses, one per turn, before
it waits for work, and serves requests meanwhile (issue 21: the start captures only the first
buckets; `test_lazy_graphs_gpu.py` runs the captures themselves)."""

from __future__ import annotations

import queue
import time

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.engine.loop import EngineLoop, decode_outputs
from pegainfer.core.engine.messages import EngineRequest
from pegainfer.models.qwen3.line import Qwen3Line
from tests.engine_harness import greedy

DEADLINE_S = 60.0


def test_the_idle_loop_captures_pending_graphs_then_waits(tmp_path, monkeypatch):
    Qwen3Line().write_tiny_checkpoint(tmp_path, seed=3)
    engine = EngineCore(EngineArgs(model=str(tmp_path), device="cpu", max_model_len=128))
    assert engine.capture_pending_graph() is False  # a CPU engine has no graphs
    pending, calls = [3, 2, 1], queue.SimpleQueue()

    def capture() -> bool:  # three buckets left, captured one per call
        calls.put(bool(pending))
        return bool(pending) and pending.pop() > 0

    monkeypatch.setattr(engine, "capture_pending_graph", capture)
    engine_loop = EngineLoop(engine)
    outputs: queue.SimpleQueue[bytes] = queue.SimpleQueue()
    engine_loop.start(outputs.put)
    try:
        made = [calls.get(timeout=DEADLINE_S) for _ in range(4)]
        assert made == [True, True, True, False]  # then it blocks: no call while it waits
        time.sleep(0.2)
        assert calls.empty()
        engine_loop.send(EngineRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                                       params=greedy(4), eos_token_ids=[],
                                       arrival_time=0))  # fmt: skip
        tokens, finished = [], False
        while not finished:
            batch = decode_outputs(outputs.get(timeout=DEADLINE_S)).outputs
            tokens += [t for o in batch for t in o.new_token_ids]
            finished = any(o.finished for o in batch)
        assert len(tokens) == 4
    finally:
        engine_loop.shutdown()
