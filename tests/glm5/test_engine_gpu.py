"""GLM-5 on CUDA (bf16: DeepSeek sparse attention through the Triton indexer scores, torch's
top-k and FlashInfer's MLA over page-size-1 selections, dense MLA while a step's sequences fit
in index_topk, decode CUDA graphs) against transformers in bf16, at the golden gate's
tolerances.

GLM-5's attention geometry (latent 512, rope key 64, nope 192, value 256, q-LoRA; 32 index
heads of 128) and its MoE structure (dense layers first, sigmoid + correction-bias routing, a
shared expert) at a small width, with a shared-indexer layer and an index_topk small enough
that the gate's prompts attend sparsely; and GLM-5's real widths at reduced depth."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from tests.latent_moe_gate import run_real_width_gate, run_small_gate, write_gate_checkpoint
from tests.qwen3.golden_gate import (
    assert_graph_replay_equals_eager,
)

pytestmark = pytest.mark.gpu

VOCAB = 1000
GLM_GEOMETRY = {"kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
                "v_head_dim": 256, "index_n_heads": 32, "index_head_dim": 128,
                "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-5,
                "max_position_embeddings": 202752, "tie_word_embeddings": False,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}}  # fmt: skip
SMALL = GLM_GEOMETRY | {
    "vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 384,
    "moe_intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 256, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 2,
    "index_topk": 64, "indexer_types": ["full", "full", "shared", "full"],
}  # fmt: skip
# GLM-5's widths (models.md 2.5) at 4 layers: three dense, one MoE with all 256 experts.
GLM5_REDUCED = GLM_GEOMETRY | {
    "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
    "moe_intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 64,
    "num_key_value_heads": 64, "q_lora_rank": 2048, "n_routed_experts": 256,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 3,
    "index_topk": 2048,
}  # fmt: skip
SMALL_LAYER_OUT, REDUCED_LAYER_OUT = 0.25, 0.05


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm5-gpu")
    write_gate_checkpoint(path, SMALL, SMALL_LAYER_OUT, seed=3, model="GlmMoeDsa")
    engine = EngineCore(EngineArgs(model=str(path), device="cuda", dtype="bfloat16",
                                   max_model_len=4096, max_num_seqs=16,
                                   gpu_memory_utilization=0.5))  # fmt: skip
    return path, engine


def test_the_engine_runs_sparse_attention_and_decode_graphs(small):
    from pegainfer.core.attention.sparse import FlashInferSparseLatent, kernel_scores

    _, engine = small
    assert isinstance(engine.model.attn.sparse, FlashInferSparseLatent)
    assert engine.model.attn.scores is kernel_scores
    assert set(engine.kv_cache.arenas) == {"ckv", "kpe", "index_k"}
    assert engine.kv_cache["index_k"].shape[0] == 3  # the full-indexer layers
    assert engine.runner.graphs is not None and 16 in engine.runner.graphs.buckets


def test_graph_replay_equals_eager_for_the_same_batch(small):
    """Decodes of 2 to 41 keys (index_topk 64): the graph's sparse attention over every key."""
    assert_graph_replay_equals_eager(small[1])


def test_small_golden_gate(small):
    """Nine cases of up to 200 tokens (index_topk 64: most attend sparsely) batched in the
    16-graph, five in the 8-graph, after a prefix hit and eagerly, plus a 1,500-token prompt
    (prefill chunks past index_topk)."""
    path, engine = small
    run_small_gate(path, engine, "GlmMoeDsa", VOCAB)


@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    """GLM-5's widths at 4 layers with random weights (written by transformers), or
    GLM5_GATE_DIR."""
    path = Path(os.environ.get("GLM5_GATE_DIR") or tmp_path_factory.mktemp("glm5-reduced"))
    if not (path / "config.json").exists():
        write_gate_checkpoint(path, GLM5_REDUCED, REDUCED_LAYER_OUT, seed=0, model="GlmMoeDsa")
    return path


@pytest.mark.slow
def test_golden_gate_at_glm5_widths(reduced):
    """Batch 1 (twice, bit-identical), batch 9 in the 16-graph, a prefix hit, and an
    8,000-token prompt (past index_topk 2048: sparse prefill chunks), against transformers in
    bf16 and float32."""
    run_real_width_gate(
        reduced,
        "GlmMoeDsa",
        GLM5_REDUCED["vocab_size"],
        num_cases=18,
        long_prompt=8000,
        max_model_len=16384,
    )
