"""Engines built one after another in one process, as the offline API's users do: a closed
engine gives its GPU memory back (weights, KV cache, graphs and their pools, attention
workspaces), so the next one sizes the same KV cache at the same gpu_memory_utilization, and a
cycle of build and close leaves nothing behind (CUDA; skipped elsewhere)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pegainfer import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.line("qwen3")]


def build_generate_close(path: Path) -> int:
    """Build an engine at half the GPU, decode through its graphs and an eager prefill, close
    it; the KV blocks it had."""
    with LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=8,
             gpu_memory_utilization=0.5) as llm:  # fmt: skip
        blocks = llm.engine.block_manager.num_blocks
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        assert all(r.finish_reason == "length" for r in llm.generate(["Hello", "a b c"], params))
    return blocks


def test_a_closed_engine_gives_its_gpu_memory_back(tmp_path):
    from pegainfer.models.qwen3.line import Qwen3Line
    from tests.qwen3.test_engine_gpu import SMALL

    # The small gate's geometry (head_dim 128: the attention modules other tests built), with
    # the tiny checkpoint's tokenizer and vocabulary.
    layers = {k: v for k, v in SMALL.items() if k not in ("vocab_size", "max_position_embeddings")}
    Qwen3Line().write_tiny_checkpoint(tmp_path, seed=0, **layers)
    first = build_generate_close(tmp_path)  # at 0.5: a second could not fit beside it
    after_first = torch.cuda.memory_allocated()
    second = build_generate_close(tmp_path)
    # The second cycle finds the same memory free and leaves no more behind than the first
    # (what libraries keep once loaded is there after both: cuBLAS keeps a workspace per
    # stream it ran on, a few MiB each; the engine's KV cache alone is tens of GiB).
    assert abs(second - first) <= first // 100, (first, second)
    assert torch.cuda.memory_allocated() - after_first < 256 << 20
