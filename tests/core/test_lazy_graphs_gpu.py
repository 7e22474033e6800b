"""Decode graphs captured while serving (issue 21): one process captures the small buckets and
the largest before it is ready, then a step captures its own bucket when it first needs it and
an idle engine captures the rest; a step on a graph captured late decodes exactly as on the
same graph captured up front. Small Qwen3, Qwen3.5 and DeepSeek models at their real head
geometry (CUDA; skipped elsewhere)."""

from __future__ import annotations

import gc
import random

import pytest

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from tests.core.test_warmup_gpu import WRITERS
from tests.engine_harness import generate, greedy

pytestmark = pytest.mark.gpu


def engine_for(path) -> EngineCore:
    return EngineCore(EngineArgs(model=str(path), device="cuda", dtype="bfloat16",
                                 max_model_len=512, max_num_seqs=32, max_num_batched_tokens=512,
                                 gpu_memory_utilization=0.2))  # fmt: skip


@pytest.mark.parametrize("line", sorted(WRITERS))  # a line not installed skips
def test_a_bucket_captured_while_serving_decodes_as_one_captured_first(line, tmp_path):
    WRITERS[line](tmp_path)
    rng = random.Random(0)
    # 20 sequences decode together: bucket 24, not among the first captured.
    prompts = [[rng.randrange(1, 900) for _ in range(rng.randrange(3, 40))] for _ in range(20)]

    reference = engine_for(tmp_path)
    while reference.capture_pending_graph():  # an idle engine's work: every bucket
        pass
    graphs = reference.runner.graphs
    assert graphs.captured == graphs.buckets == (1, 2, 4, 8, 16, 24, 32) and not graphs.pending
    expected = generate(reference, prompts, greedy(12))
    reference.shutdown()
    del reference, graphs
    gc.collect()  # its cache and graphs go before the next engine sizes its own

    engine = engine_for(tmp_path)
    graphs = engine.runner.graphs
    assert graphs.captured == (1, 2, 4, 8, 32) and graphs.pending == [24, 16]
    assert generate(engine, prompts, greedy(12)) == expected
    assert 24 in graphs.captured  # the decode steps captured their bucket
    while engine.capture_pending_graph():
        pass
    assert graphs.captured == graphs.buckets
    engine.shutdown()
