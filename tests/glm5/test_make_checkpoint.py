"""`pegainfer-bench make-checkpoint glm5*`: GLM-5's layouts (bf16, GLM-5-FP8's blocks) around
random weights, cut to any depth and expert count. Real widths take gigabytes, so the shapes
here are GLM-5's structure at a small width."""

from __future__ import annotations

import json

import pytest
import torch

from pegainfer import LLM, SamplingParams
from pegainfer.server.bench import make_checkpoint as mc
from tests.quant_checkpoints import stored_tensors

SMALL = {"vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
         "moe_intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
         "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
         "qk_rope_head_dim": 32, "v_head_dim": 32, "index_head_dim": 64,
         "index_topk": 8}  # fmt: skip
INDEXER = "model.layers.3.self_attn.indexer."


@pytest.fixture
def small_shapes(monkeypatch):
    """The published layouts at a small width (the vocabulary too: embeddings dominate)."""
    for name, config in mc.GLM5_SHAPES.items():
        monkeypatch.setitem(mc.GLM5_SHAPES, name, config | SMALL)
        monkeypatch.setitem(mc.LATENT_MOE_SHAPES, name, config | SMALL)


def generates(path, **args) -> list[int]:
    """Four greedy tokens after a prompt longer than index_topk (sparse attention)."""
    llm = LLM(str(path), device="cpu", max_model_len=128, **args)
    prompt = "Hello there, a prompt long enough to attend to only some of its keys"
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    return llm.generate([prompt], params)[0].token_ids


@pytest.mark.usefixtures("small_shapes")
def test_bf16_cut_to_depth_and_experts_with_the_published_config(tmp_path):
    mc.make_checkpoint("glm5", tmp_path, device="cpu", num_shards=2, num_layers=4, num_experts=8)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["n_routed_experts"]) == (4, 8)
    assert config["model_type"] == "glm_moe_dsa" and config["index_n_heads"] == 32
    tensors = stored_tensors(tmp_path)
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in tensors
    assert tensors[INDEXER + "weights_proj.weight"].dtype == torch.float32
    assert tensors[INDEXER + "wq_b.weight"].dtype == torch.bfloat16
    total = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert total["metadata"]["total_size"] == mc.latent_moe_bytes(config)
    assert len(generates(tmp_path)) == 4


@pytest.mark.usefixtures("small_shapes")
def test_fp8_stores_the_indexers_projections_quantized_and_serves(tmp_path):
    mc.make_checkpoint("glm5-fp8", tmp_path, device="cpu", num_shards=2, num_layers=4,
                       num_experts=8)  # fmt: skip
    tensors = stored_tensors(tmp_path)
    for module in ("self_attn.indexer.wq_b", "self_attn.indexer.wk",
                   "self_attn.kv_a_proj_with_mqa", "mlp.experts.7.gate_proj"):  # fmt: skip
        assert tensors[f"model.layers.3.{module}.weight"].dtype == torch.float8_e4m3fn
        assert tensors[f"model.layers.3.{module}.weight_scale_inv"].dtype == torch.float32
    assert tensors[INDEXER + "weights_proj.weight"].dtype == torch.float32
    assert tensors["model.layers.3.mlp.gate.weight"].dtype == torch.bfloat16
    assert len(generates(tmp_path)) == 4


def test_sizes_are_the_published_model():
    """GLM-5's 743.9 B parameters (models.md, counted by transformers on the meta device: the
    indexers' float32 head weights one parameter each, the routers' correction biases none)."""
    size = mc.latent_moe_bytes(mc.GLM5_SHAPES["glm5"])
    head_weights, biases = 78 * 32 * 6144, 75 * 256
    params = (size - 4 * head_weights - 4 * biases) // 2 + head_weights
    assert round(params / 1e8) == 7439


@pytest.mark.usefixtures("small_shapes")
@pytest.mark.parametrize("shape", ["glm5", "glm5-fp8"])
def test_random_weights_drawn_in_place_serve_a_config_only_checkpoint(tmp_path, shape):
    mc.make_checkpoint(shape, tmp_path, device="cpu", num_layers=4, num_experts=8, weights=False)
    assert not list(tmp_path.glob("*.safetensors*"))
    first = generates(tmp_path, load_format="dummy")
    assert first == generates(tmp_path, load_format="dummy") and len(first) == 4
