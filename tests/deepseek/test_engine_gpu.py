"""DeepSeek-V2 on CUDA (bf16: MLA absorbed through FlashInfer's MLA kernels and expanded through
its ragged prefill, the Triton kernels, decode CUDA graphs) against transformers in bf16, at the
golden gate's tolerances.

V2-Lite's attention geometry (latent 512, rope key 64, nope 128, value 128, its YaRN) and its
MoE structure (a dense first layer, top-k routed experts plus a shared one) at a small width."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.server.bench.make_checkpoint import DEEPSEEK_SHAPES
from tests.deepseek.hf_reference import SMALL
from tests.latent_moe_gate import run_real_width_gate, run_small_gate, write_gate_checkpoint
from tests.qwen3.golden_gate import (
    PIECEWISE_LENGTHS,
    assert_graph_replay_equals_eager,
    assert_pieces_match_eager,
)

pytestmark = pytest.mark.gpu

VOCAB = 1000
LITE_GEOMETRY = {"vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 384,
                 "moe_intermediate_size": 128, "num_hidden_layers": 3,
                 "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 512,
                 "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                 "n_routed_experts": 8, "num_experts_per_tok": 2,
                 "max_position_embeddings": 163840,
                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                     "original_max_position_embeddings": 4096,
                                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                                     "mscale_all_dim": 0.707}}  # fmt: skip
# V2's routing as the published checkpoints configure it, and untied embeddings.
GATE_ROUTING = {"topk_method": "greedy", "n_group": 1, "topk_group": 1,
                "norm_topk_prob": False, "routed_scaling_factor": 1.0,
                "tie_word_embeddings": False}  # fmt: skip
# DeepSeek-V2-Lite's text config as transformers names it (make-checkpoint's shape, HF keys).
V2_LITE = {k: v for k, v in DEEPSEEK_SHAPES["deepseek-v2-lite"].items()
           if k not in ("rope_scaling", "torch_dtype")} | {
    "rope_parameters": LITE_GEOMETRY["rope_parameters"]} | GATE_ROUTING  # fmt: skip
# The share of the residual the layers write (write_gate_checkpoint): peaked distributions.
SMALL_LAYER_OUT, V2_LITE_LAYER_OUT = 0.25, 0.01


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """V2-Lite's geometry at a small width, with the gate's recipe for peaked distributions
    (transformers' default init at this width puts its own bf16 run 0.18 nat from float32
    on average: too noisy a yardstick)."""
    path = tmp_path_factory.mktemp("deepseek-gpu")
    write_gate_checkpoint(path, SMALL | LITE_GEOMETRY | GATE_ROUTING, SMALL_LAYER_OUT, seed=3)
    engine = EngineCore(EngineArgs(model=str(path), device="cuda", dtype="bfloat16",
                                   max_model_len=4096, max_num_seqs=16,
                                   gpu_memory_utilization=0.5))  # fmt: skip
    return path, engine


def test_the_engine_runs_flashinfer_mla_and_decode_graphs(small):
    from pegainfer.core.attention.latent import (
        FlashInferPagedLatentAttention,
        FlashInferRaggedAttention,
    )

    _, engine = small
    assert isinstance(engine.model.attn.absorbed, FlashInferPagedLatentAttention)
    assert isinstance(engine.model.attn.expanded, FlashInferRaggedAttention)
    assert engine.runner.graphs is not None and 16 in engine.runner.graphs.buckets


@pytest.mark.parametrize("lengths", PIECEWISE_LENGTHS)
def test_piecewise_mixed_step_matches_eager(small, lengths):
    """MLA (absorbed and, for the 1000-token chunk, expanded) and the fused MoE between the
    pieces: mixed steps replayed piecewise match the eager step."""
    assert_pieces_match_eager(small[1], lengths)


def test_graph_replay_equals_eager_for_the_same_batch(small):
    assert_graph_replay_equals_eager(small[1])


def test_small_golden_gate(small):
    """Nine cases batched in the 16-graph, five in the 8-graph, after a prefix hit and eagerly,
    plus a 1,500-token prompt (one prefill from position 0: the expanded form). Absorbed rows:
    every decode, and the prefix-hit pass's chunks over their cached prefixes."""
    path, engine = small
    run_small_gate(path, engine, "DeepseekV2", VOCAB)


@pytest.fixture(scope="module")
def v2_lite(tmp_path_factory):
    """DeepSeek-V2-Lite shapes with random weights (written by transformers), or
    DEEPSEEK_GATE_DIR."""
    path = Path(os.environ.get("DEEPSEEK_GATE_DIR") or tmp_path_factory.mktemp("v2-lite"))
    if not (path / "config.json").exists():
        write_gate_checkpoint(path, V2_LITE, V2_LITE_LAYER_OUT, seed=0)
    return path


@pytest.mark.slow
def test_golden_gate_at_deepseek_v2_lite_shapes(v2_lite):
    """Batch 1 (twice, bit-identical), batch 9 in the 16-graph, a prefix hit, and a
    4,500-token prompt, against transformers in bf16 and float32."""
    run_real_width_gate(
        v2_lite,
        "DeepseekV2",
        V2_LITE["vocab_size"],
        num_cases=27,
        long_prompt=4500,
        max_model_len=8192,
    )
