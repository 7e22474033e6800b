"""Large step budgets (issue 19: `--max-num-batched-tokens 8192` did not start within 180 s, its
pieces captured for 37 token buckets): an engine with an 8,192- or 16,384-token budget starts
with only the short steps' pieces captured, captures a larger bucket when a step first needs
it, and runs a step past the pieces' cap eagerly, with exactly the eager step's logits. Small
Qwen3 and DeepSeek models at their real head geometry (CUDA; skipped elsewhere)."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.runner.forward_batch import ForwardBatch
from pegainfer.core.runner.memory import pieces_bytes_per_token
from pegainfer.core.runner.mixed_buckets import first_token_buckets, token_buckets
from tests.core.test_warmup_gpu import WRITERS
from tests.qwen3.golden_gate import assert_pieces_match_eager

pytestmark = pytest.mark.gpu

CAP = 512
# Generous: the small models start in seconds on warm caches; 37 buckets' pieces took minutes.
START_S = 90.0


def start(path, budget: int) -> tuple[EngineCore, float]:
    began = time.perf_counter()
    engine = EngineCore(EngineArgs(model=str(path), device="cuda", dtype="bfloat16",
                                   max_model_len=4096, max_num_seqs=16,
                                   max_num_batched_tokens=budget, max_mixed_graph_tokens=CAP,
                                   gpu_memory_utilization=0.3))  # fmt: skip
    return engine, time.perf_counter() - began


def step_past_the_cap(engine: EngineCore, chunk: int) -> ForwardBatch:
    """Three one-token prompts (decode rows: a query row each) beside a `chunk`-token prompt, on
    fresh blocks of the engine's cache: every key the step reads, it writes."""
    bs, manager = engine.config.block_size, engine.block_manager
    fresh = [(7 * k) % 900 + 1 for k in range(chunk)]
    tables = [manager.allocate(1) for _ in range(3)] + [manager.allocate(-(-chunk // bs))]
    return ForwardBatch.build([[7], [8], [9], fresh], [0] * 4, tables, [True] * 4, bs,
                              torch.device("cuda"))  # fmt: skip


@pytest.mark.parametrize(("line", "budget"), [("qwen3", 8192), ("qwen3", 16384),
                                              ("deepseek", 8192)])  # fmt: skip
def test_a_big_budget_starts_with_the_short_pieces_and_runs_big_steps_eagerly(
    line, budget, tmp_path
):
    WRITERS[line](tmp_path)
    engine, seconds = start(tmp_path, budget)
    try:
        pieces = engine.runner.mixed_graphs
        assert pieces is not None and pieces.buckets == token_buckets(CAP)
        assert pieces.captured == first_token_buckets(pieces.buckets) == (16, 32, 64, 128, 256)
        assert seconds < START_S, f"the engine took {seconds:.1f} s to start"

        # A bucket past the first ones: the step captures it, and its pieces match eager.
        assert_pieces_match_eager(engine, (400,))  # 403 tokens: bucket 512
        assert 512 in pieces.captured and pieces.pending == [384]

        # What KV sizing reserved for the pieces: every bucket holds its cuts' inputs and its
        # final states, `pieces_bytes_per_token` a token (the idle engine's capture of 384).
        bs, model = engine.config.block_size, engine.model
        per_token = pieces_bytes_per_token(model, model.kv_arenas(bs), model.state_arenas(), bs,
                                           torch.device("cuda"))  # fmt: skip
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        assert engine.capture_pending_graph() and not pieces.pending  # decode graphs: all first
        grown = torch.cuda.memory_allocated() - before
        assert 384 * per_token <= grown <= 1.25 * 384 * per_token + (2 << 20), (grown, per_token)

        # Past the cap: eager, the same kernels as the model's own forward.
        batch = step_past_the_cap(engine, 3000)
        assert not pieces.can_run(batch) and not engine.runner.graphs.can_run(batch)
        with torch.inference_mode():
            served = engine.runner.forward(batch).clone()
            engine.model.prepare(batch)
            eager = engine.model(batch, engine.kv_cache)
        assert torch.equal(served, eager)
        assert pieces.captured[-1] == 512  # nothing captured for it
        for table in batch.block_tables_cpu:
            engine.block_manager.release(table)
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
