"""Kimi-K2 on CUDA (bf16: MLA absorbed through FlashInfer's MLA kernels and expanded through its
ragged prefill, the noaux_tc routing and fused MoE Triton kernels, decode CUDA graphs, mixed
steps replayed in pieces) against transformers' DeepseekV3ForCausalLM in bf16, at the golden
gate's tolerances.

Kimi-K2's attention geometry (q LoRA, latent 512, rope key 64, nope 128, value 128, its YaRN)
and MoE structure (a dense first layer, sigmoid + correction-bias routing, a shared expert) at a
small width; and Kimi-K2's real widths at reduced depth."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from tests.latent_moe_gate import run_real_width_gate, run_small_gate, write_gate_checkpoint
from tests.qwen3.golden_gate import (
    PIECEWISE_LENGTHS,
    assert_graph_replay_equals_eager,
    assert_pieces_match_eager,
)

pytestmark = pytest.mark.gpu

VOCAB = 1000
# Kimi-K2-Instruct's config.json (models.md 2.4), but for its depth and expert count.
KIMI_GEOMETRY = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                 "v_head_dim": 128, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                 "routed_scaling_factor": 2.827, "rms_norm_eps": 1e-6,
                 "max_position_embeddings": 131072, "tie_word_embeddings": False,
                 "first_k_dense_replace": 1, "n_shared_experts": 1,
                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0,
                                     "original_max_position_embeddings": 4096,
                                     "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                                     "mscale_all_dim": 1.0}}  # fmt: skip
SMALL = KIMI_GEOMETRY | {
    "vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 384,
    "moe_intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 192, "n_routed_experts": 16,
    "num_experts_per_tok": 4,
}  # fmt: skip
# Kimi-K2's widths at reduced depth: by default a dense layer and a MoE layer with all 384
# experts (38 GB in bf16; transformers' float32 reference twice that). KIMI_GATE_LAYERS and
# KIMI_GATE_EXPERTS choose others (4 layers of 384 experts: 106 GB, past one H200's disk).
KIMI_REDUCED = KIMI_GEOMETRY | {
    "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_attention_heads": 64, "num_key_value_heads": 64,
    "q_lora_rank": 1536, "num_experts_per_tok": 8,
    "num_hidden_layers": int(os.environ.get("KIMI_GATE_LAYERS", 2)),
    "n_routed_experts": int(os.environ.get("KIMI_GATE_EXPERTS", 384)),
}  # fmt: skip
SMALL_LAYER_OUT, REDUCED_LAYER_OUT = 0.25, 0.05


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi-gpu")
    write_gate_checkpoint(path, SMALL, SMALL_LAYER_OUT, seed=3, model="DeepseekV3")
    engine = EngineCore(EngineArgs(model=str(path), device="cuda", dtype="bfloat16",
                                   max_model_len=4096, max_num_seqs=16,
                                   gpu_memory_utilization=0.5))  # fmt: skip
    return path, engine


def test_the_engine_runs_flashinfer_mla_and_decode_graphs(small):
    from pegainfer.core.attention.latent import (
        FlashInferPagedLatentAttention,
        FlashInferRaggedAttention,
    )
    from pegainfer.models.kimi_k2.model import KimiK2ForCausalLM

    _, engine = small
    assert isinstance(engine.model, KimiK2ForCausalLM)
    assert isinstance(engine.model.attn.absorbed, FlashInferPagedLatentAttention)
    assert isinstance(engine.model.attn.expanded, FlashInferRaggedAttention)
    assert engine.model.layers[1].mlp.e_score_correction_bias.dtype == torch.float32
    assert engine.runner.graphs is not None and 16 in engine.runner.graphs.buckets


@pytest.mark.parametrize("lengths", PIECEWISE_LENGTHS)
def test_piecewise_mixed_step_matches_eager(small, lengths):
    assert_pieces_match_eager(small[1], lengths)


def test_graph_replay_equals_eager_for_the_same_batch(small):
    assert_graph_replay_equals_eager(small[1])


def test_small_golden_gate(small):
    """Nine cases batched in the 16-graph, five in the 8-graph, after a prefix hit and eagerly,
    plus a 1,500-token prompt (one prefill from position 0: the expanded form)."""
    path, engine = small
    run_small_gate(path, engine, "DeepseekV3", VOCAB)


@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    """Kimi-K2's widths at reduced depth with random weights (written by transformers), or
    KIMI_GATE_DIR."""
    path = Path(os.environ.get("KIMI_GATE_DIR") or tmp_path_factory.mktemp("kimi-reduced"))
    if not (path / "config.json").exists():
        write_gate_checkpoint(path, KIMI_REDUCED, REDUCED_LAYER_OUT, seed=0, model="DeepseekV3")
        torch.cuda.empty_cache()
    return path


@pytest.mark.slow
def test_golden_gate_at_kimi_k2_widths(reduced):
    """Batch 1 (twice, bit-identical), batch 9 in the 16-graph, a prefix hit, and a
    4,500-token prompt, against transformers in bf16 and float32."""
    run_real_width_gate(
        reduced,
        "DeepseekV3",
        KIMI_REDUCED["vocab_size"],
        num_cases=18,
        long_prompt=4500,
        max_model_len=8192,
    )
