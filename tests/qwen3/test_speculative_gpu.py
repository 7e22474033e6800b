"""Speculative decoding on CUDA (bf16, decode graphs for the draft forwards, piecewise graphs
for the verify steps): greedy output equals plain decoding's, and the model drafting for
itself has every draft accepted (CUDA; skipped elsewhere)."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.engine_harness import generate, greedy
from tests.qwen3.golden_gate import write_gate_checkpoint
from tests.qwen3.test_engine_gpu import SMALL, SMALL_LAYER_OUT, gpu_engine

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-speculative-gpu")
    write_gate_checkpoint(path, SMALL, SMALL_LAYER_OUT, seed=11)
    return path


def run(path, prompts, **overrides) -> tuple[list[list[int]], object]:
    engine = gpu_engine(path, num_kv_blocks=2048, **overrides)
    outputs = generate(engine, prompts, greedy(48))
    counters = engine.speculative and engine.speculative.snapshot()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return outputs, counters


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_equals_plain_decoding(path, k):
    g = torch.Generator().manual_seed(k)
    prompts = [torch.randint(0, SMALL["vocab_size"], (n,), generator=g).tolist()
               for n in (3, 17, 64, 130, 9, 250)]  # fmt: skip
    plain, _ = run(path, prompts)
    speculative, counters = run(path, prompts, speculative_tokens=k, speculative_method="self")
    assert speculative == plain
    assert counters.num_drafts > 0
    # Decode and verify forwards round differently in bf16; peaked distributions make a
    # rejected self-draft rare.
    assert counters.num_accepted_tokens >= 0.9 * counters.num_draft_tokens
