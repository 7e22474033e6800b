"""`pegainfer-bench make-checkpoint kimi-k2*`: Kimi-K2's layouts (bf16, FP8 blocks, INT4
experts) around random weights, cut to any depth and expert count. Real widths take gigabytes,
so the shapes here are Kimi's structure at a small width."""

from __future__ import annotations

import json

import pytest
import torch

from pegainfer import LLM, SamplingParams
from pegainfer.core.loading.model_files import read_config
from pegainfer.core.model import ModelContext
from pegainfer.core.model_line import RuntimeConfig
from pegainfer.models.kimi_k2.line import KimiK2Line
from pegainfer.server.bench import make_checkpoint as mc
from tests.paged_runner import PagedRunner
from tests.quant_checkpoints import stored_tensors

SMALL = {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128,
         "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 128,
         "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32,
         "v_head_dim": 32}  # fmt: skip


@pytest.fixture
def small_shapes(monkeypatch):
    """The published layouts at a small width (the vocabulary too: embeddings dominate)."""
    for name, config in mc.KIMI_SHAPES.items():
        small = config | SMALL | {"vocab_size": 1024}
        monkeypatch.setitem(mc.KIMI_SHAPES, name, small)
        monkeypatch.setitem(mc.LATENT_MOE_SHAPES, name, small)


@pytest.mark.usefixtures("small_shapes")
def test_bf16_cut_to_depth_and_experts_with_the_published_config(tmp_path):
    mc.make_checkpoint(
        "kimi-k2", tmp_path, device="cpu", num_shards=2, num_layers=3, num_experts=16
    )
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["n_routed_experts"]) == (3, 16)
    assert config["model_type"] == "kimi_k2" and config["topk_method"] == "noaux_tc"
    assert (config["num_experts_per_tok"], config["routed_scaling_factor"]) == (8, 2.827)
    tensors = stored_tensors(tmp_path)
    assert "model.layers.2.mlp.experts.15.down_proj.weight" in tensors
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    total = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert total["metadata"]["total_size"] == mc.latent_moe_bytes(config)
    llm = LLM(str(tmp_path), device="cpu", max_model_len=128)
    [out] = llm.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4


@pytest.mark.usefixtures("small_shapes")
@pytest.mark.parametrize(("shape", "expert", "attention"), [
    ("kimi-k2-fp8", {"weight": torch.float8_e4m3fn, "weight_scale_inv": torch.float32},
     {"weight": torch.float8_e4m3fn, "weight_scale_inv": torch.float32}),
    ("kimi-k2-int4", {"weight_packed": torch.int32, "weight_scale": torch.bfloat16,
                      "weight_shape": torch.int64}, {"weight": torch.bfloat16}),
])  # fmt: skip
def test_quantized_layouts_store_and_serve(tmp_path, shape, expert, attention):
    mc.make_checkpoint(shape, tmp_path, device="cpu", num_shards=2, num_layers=2, num_experts=8)
    tensors = stored_tensors(tmp_path)
    layer = "model.layers.1."
    for suffix, dtype in expert.items():
        assert tensors[f"{layer}mlp.experts.7.gate_proj.{suffix}"].dtype == dtype
    for suffix, dtype in attention.items():
        assert tensors[f"{layer}self_attn.kv_a_proj_with_mqa.{suffix}"].dtype == dtype
    assert tensors["lm_head.weight"].dtype == torch.bfloat16
    assert tensors[f"{layer}mlp.gate.weight"].dtype == torch.bfloat16
    llm = LLM(str(tmp_path), device="cpu", max_model_len=128)
    [out] = llm.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4


def test_depth_and_experts_cut_only_latent_moe_shapes(tmp_path):
    with pytest.raises(ValueError, match="apply to latent-MoE shapes, not .qwen3-8b."):
        mc.make_checkpoint("qwen3-8b", tmp_path, num_layers=2)


def test_sizes_are_the_published_models():
    """Kimi-K2's 1,026.4 B parameters and DeepSeek-V2-Lite's 31.4 GB in bf16 (models.md,
    counted by transformers on the meta device), which set the default shard counts."""
    kimi = mc.latent_moe_bytes(mc.KIMI_SHAPES["kimi-k2"])
    assert round((kimi - 60 * 4 * 384) / 2 / 1e8) == 10264
    assert round(mc.latent_moe_bytes(mc.DEEPSEEK_SHAPES["deepseek-v2-lite"]) / 1e8) == 314


@pytest.mark.usefixtures("small_shapes")
@pytest.mark.parametrize("shape", ["kimi-k2", "kimi-k2-fp8", "kimi-k2-int4"])
def test_random_weights_drawn_in_place_serve_a_config_only_checkpoint(tmp_path, shape):
    """`--no-weights` then `--load-format dummy`: no weight file anywhere, the model built in
    the checkpoint's layout and its weights drawn on the device (norms 1, the same draw every
    time), generating finite scores."""
    mc.make_checkpoint(shape, tmp_path, device="cpu", num_layers=2, num_experts=8, weights=False)
    assert not list(tmp_path.glob("*.safetensors*"))
    runs = []
    for _ in range(2):
        llm = LLM(str(tmp_path), device="cpu", max_model_len=128, load_format="dummy")
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        runs.append(llm.generate(["Hello"], params)[0].token_ids)
    assert runs[0] == runs[1] and len(runs[0]) == 4
    ctx = ModelContext(tmp_path, read_config(tmp_path), torch.float32, torch.device("cpu"),
                       random_weights=True)  # fmt: skip
    model = KimiK2Line().build_model(ctx)
    model.init_runtime(RuntimeConfig(block_size=4, max_model_len=128,
                                     max_num_batched_tokens=128, max_num_seqs=4))  # fmt: skip
    assert torch.equal(model.norm, torch.ones_like(model.norm))
    experts = model.layers[1].mlp.experts.gate_up_proj
    stored = experts if isinstance(experts, torch.Tensor) else experts.stored()[0]
    assert stored.float().std() > 0
    logits = PagedRunner(model).step({"a": list(range(40))})["a"]
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_an_unknown_load_format_is_refused():
    from pegainfer.core.args import EngineArgs
    from pegainfer.core.errors import ConfigError

    with pytest.raises(ConfigError, match="load_format must be one of auto, dummy"):
        EngineArgs(model="x", load_format="pt").validate()
