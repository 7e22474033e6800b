"""Kimi-K2 from its quantized layouts on CUDA (128x128 FP8 blocks in every decoder linear layer,
as Kimi-K2-Instruct; INT4 groups of 32 in the routed experts, as Kimi-K2-Thinking): graph replay
equals eager, and the golden gate against transformers (bf16 and float32) on the exactly
dequantized weights, with weight-only GEMMs (the fused MoE dequantizing its tiles); FP8's
prefill with activations quantized per 1x128 stays within the loose tier."""

from __future__ import annotations

import json

import pytest
import torch

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.kernels import quant_gemm
from pegainfer.core.quant.linear import QuantLinear
from tests.kimi_k2.test_engine_gpu import SMALL, SMALL_LAYER_OUT, VOCAB
from tests.kimi_k2.test_quantized_checkpoints import INT4, is_linear
from tests.latent_moe_gate import hf_references, write_gate_checkpoint
from tests.quant_checkpoints import FP8_BLOCK_CONFIG, quantize_checkpoint
from tests.qwen3.golden_gate import (
    TeacherForcer,
    assert_graph_replay_equals_eager,
    judge,
    make_cases,
    small_gate_passes,
)
from tests.qwen3.test_fp8_engine_gpu import LOOSE_REGRET

pytestmark = pytest.mark.gpu

# FP8 blocks of 128 rows: the fused q_a | kv_a projection's parts start on a block row.
QUANTIZABLE = SMALL | {"q_lora_rank": 256}


@pytest.fixture(scope="module", params=["fp8", "int4"])
def quantized(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"kimi-{request.param}-gpu")
    write_gate_checkpoint(root / "bf16", QUANTIZABLE, SMALL_LAYER_OUT, seed=5, model="DeepseekV3")
    config = FP8_BLOCK_CONFIG if request.param == "fp8" else INT4
    quantize_checkpoint(root / "bf16", root / "quantized", config, is_linear, root / "dequant")
    engine = EngineCore(EngineArgs(model=str(root / "quantized"), device="cuda",
                                   dtype="bfloat16", max_model_len=4096, max_num_seqs=16,
                                   gpu_memory_utilization=0.5))  # fmt: skip
    assert isinstance(engine.model.layers[1].mlp.experts.gate_up_proj, QuantLinear)
    cases = make_cases(9, vocab=VOCAB, max_prompt=200, decode=8, seed=0)
    refs = hf_references(root / "dequant", cases, "DeepseekV3")
    return request.param, engine, cases, refs[torch.bfloat16], refs[torch.float32]


def test_graph_replay_equals_eager(quantized):
    assert_graph_replay_equals_eager(quantized[1])


def test_golden_gate_with_weight_only_gemms(quantized, monkeypatch):
    _, engine, cases, refs16, refs32 = quantized
    monkeypatch.setattr(quant_gemm, "W8A8_MIN_ROWS", 1 << 30)
    passes = small_gate_passes(TeacherForcer(engine), cases)
    print(json.dumps(judge(passes, refs16, refs32), indent=2))


def test_fp8_activations_in_prefill_stay_in_the_loose_tier(quantized):
    name, engine, cases, refs16, refs32 = quantized
    if name != "fp8":
        pytest.skip("INT4 checkpoints keep attention and dense layers in bf16")
    assert any(len(c.prompt) >= quant_gemm.W8A8_MIN_ROWS for c in cases)
    passes = {"w8a8_prefill": TeacherForcer(engine).run(cases, graphs=False)}
    summary = judge(passes, refs16, refs32, check=False)
    print(json.dumps(summary, indent=2))
    gate = summary["w8a8_prefill vs hf_bf16"]
    assert gate["max_regret"] <= LOOSE_REGRET and gate["outside_hf_top64"] == 0, gate
