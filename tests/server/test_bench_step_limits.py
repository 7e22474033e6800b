"""What `benchmarks/model_step.py`'s limits count (`pegainfer.server.bench.step_limits`): weight
elements as the matmuls see them whatever the storage, the routed experts a batch touches, the
KV a decode step reads and causal attention's FLOPs, dense and sparse."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pegainfer.core.kv.kv_cache import ArenaSpec
from pegainfer.core.matmul_weights import MatmulWeights
from pegainfer.server.bench import make_checkpoint as mc
from pegainfer.server.bench.memory_plan import Layout, build_on_meta, shape_config
from pegainfer.server.bench.step_limits import (
    attention_flops,
    kv_read_bytes,
    measured_expert_spread,
    untouched_experts,
)
from tests.engine_harness import greedy, make_engine, submit

ROOT = Path(__file__).parents[2]
# Kimi-K2's structure at a small width (block-aligned for FP8, group-aligned for INT4).
SMALL_KIMI = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
              "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 128,
              "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32,
              "v_head_dim": 32, "vocab_size": 1024, "num_hidden_layers": 3,
              "n_routed_experts": 8}  # fmt: skip


def small_kimi(shape: str) -> torch.nn.Module:
    return build_on_meta(shape_config(shape, SMALL_KIMI), Layout())


@pytest.mark.line("kimi_k2")
def test_weight_elements_do_not_depend_on_the_storage():
    plain = MatmulWeights.of(small_kimi("kimi-k2"))
    params = dict(small_kimi("kimi-k2").named_parameters())
    outside = ("embed_tokens", "lm_head")
    assert plain.elements == sum(p.numel() for n, p in params.items() if not n.startswith(outside))
    assert plain.routed == sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
    assert plain.fp8 == 0
    int4 = MatmulWeights.of(small_kimi("kimi-k2-int4"))  # eight weights per int32, no scales
    assert (int4.elements, int4.routed, int4.fp8) == (plain.elements, plain.routed, 0)
    fp8 = MatmulWeights.of(small_kimi("kimi-k2-fp8"))
    assert (fp8.elements, fp8.routed) == (plain.elements, plain.routed)
    # FP8 outside the routed experts: every linear layer but kv_b_proj, which is dequantized
    # once loaded (attention reads it per head), and the router (never quantized).
    linear = ("q_kv_a_proj", "q_b_proj", "o_proj", "shared_experts", "mlp.gate_up_proj",
              "mlp.down_proj")  # fmt: skip
    expected = sum(p.numel() for n, p in params.items()
                   if any(part in n for part in linear) and ".mlp.experts." not in n)  # fmt: skip
    assert fp8.fp8 == expected > 0


def test_untouched_experts_match_random_routing():
    assert untouched_experts(48, 8, 1) == pytest.approx(40 / 48)
    rng = random.Random(0)
    trials = 400
    seen = sum(
        len(set().union(*(rng.sample(range(48), 8) for _ in range(16)))) for _ in range(trials)
    )
    assert 1 - seen / trials / 48 == pytest.approx(untouched_experts(48, 8, 16), abs=0.01)


@pytest.mark.line("kimi_k2")
def test_the_measured_spread_counts_the_experts_a_step_chooses(tmp_path):
    top_2_of_16 = {"n_routed_experts": 16, "num_experts_per_tok": 2}
    mc.write_weights("kimi-k2", tmp_path, overrides=SMALL_KIMI | top_2_of_16, weights=False)
    engine = make_engine(tmp_path, load_format="dummy", async_scheduling=False)
    try:
        submit(engine, "one", list(range(1, 9)), greedy(8))
        engine.step()  # the prompt; then each step decodes one token
        assert measured_expert_spread(engine) == pytest.approx(2 / 16)  # top-2 of 16
        for i in range(5):
            submit(engine, str(i), list(range(10 * i + 1, 10 * i + 9)), greedy(8))
        engine.step()
        spread = measured_expert_spread(engine)  # six tokens: 2 to 12 of the 16 experts
        assert 2 / 16 <= spread <= 12 / 16
    finally:
        engine.shutdown()


def glm_arenas(layers: int = 4) -> list[ArenaSpec]:
    return [
        ArenaSpec("ckv", layers, (16, 512), torch.bfloat16),
        ArenaSpec("kpe", layers, (16, 64), torch.bfloat16),
        ArenaSpec("index_k", layers, (16, 128), torch.bfloat16),
    ]


def test_decode_reads_every_key_or_the_selected_latents_and_every_indexer_key():
    layers, arenas = 4, glm_arenas(4)
    latent, index = layers * 2 * (512 + 64), layers * 2 * 128
    assert kv_read_bytes(arenas, 16, 1000, None) == 1000 * (latent + index)
    assert kv_read_bytes(arenas, 16, 1000, 2048) == 1000 * latent  # dense: nothing scored
    assert kv_read_bytes(arenas, 16, 5000, 2048) == 2048 * latent + 5000 * index


GLM = SimpleNamespace(num_heads=8, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192,
                      v_head_dim=256, index_topk=64, index_heads=4, index_head_dim=128)  # fmt: skip


def test_sparse_prefill_flops_sum_every_row():
    tokens, layers = 200, 4
    per_row = [
        layers * 2 * GLM.index_heads * GLM.index_head_dim * (i + 1)  # scores of earlier keys
        + layers * 2 * GLM.num_heads * (2 * 512 + 64) * min(i + 1, GLM.index_topk)
        for i in range(tokens)
    ]
    assert attention_flops(GLM, glm_arenas(layers), tokens) == pytest.approx(sum(per_row))


def test_dense_prefill_flops_are_the_causal_square():
    gqa = SimpleNamespace(num_heads=32, head_dim=128)
    assert attention_flops(gqa, glm_arenas(2)[:1], 100) == 2 * 2 * 32 * 128 * 100 * 100
    # MLA expanded; a sparse model's prompt no longer than its selection attends densely too.
    width = (192 + 64 + 256) / 2
    assert attention_flops(GLM, glm_arenas(2), 64) == 2 * 2 * 8 * width * 64 * 64


def test_model_step_refuses_cuts_of_shapes_that_have_none(tmp_path):
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "model_step.py"), "--shape", "qwen3-4b",
         "--num-layers", "2", "--out", str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "latent-MoE shapes" in run.stderr
    assert not (tmp_path / "out.json").exists()
