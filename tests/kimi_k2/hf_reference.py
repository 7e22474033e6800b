"""Tiny random DeepSeek-V3 / Kimi-K2 checkpoints written by transformers (per-expert tensors and a
float32 correction bias, as the published ones), and both models loaded from them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from pegainfer.models.kimi_k2.line import KimiK2Line
from pegainfer.models.kimi_k2.model import KimiK2ForCausalLM
from tests.paged_runner import load_model

VOCAB = 300
# Kimi-K2's structure at a small size: q-LoRA, a dense first layer, 2 of 8 routed experts by
# noaux_tc (one group) plus a shared one, YaRN with Kimi's betas and equal mscales.
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
         "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 32,
         "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
         "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
         "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
         "routed_scaling_factor": 2.827, "max_position_embeddings": 512,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "beta_fast": 1.0,
                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}  # fmt: skip
# DeepSeek-V3's generic routing: 16 experts in 4 groups, the best 2 groups kept, 4 per token;
# V3's YaRN betas; a tied head.
GROUPED = {"n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
           "routed_scaling_factor": 2.5, "tie_word_embeddings": True,
           "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                               "original_max_position_embeddings": 32, "beta_fast": 32.0,
                               "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}  # fmt: skip


def write_hf_checkpoint(
    path: Path, *, seed: int = 0, model_type: str = "kimi_k2", **overrides
) -> Path:
    """A random `DeepseekV3ForCausalLM` with norms moved away from 1, a router spread enough
    that tokens pick different experts and a correction bias that changes their choice
    (transformers initialises it to 0); config.json then says `model_type`, as Kimi-K2's
    does."""
    config = transformers.DeepseekV3Config(**(SMALL | overrides), initializer_range=0.1,
                                           bos_token_id=None, eos_token_id=None)  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0, 1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.3)
    model.save_pretrained(path)
    config_file = path / "config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) |
                                      {"model_type": model_type}))  # fmt: skip
    return path


def load_ours(path: Path, block_size: int = 4) -> KimiK2ForCausalLM:
    model = load_model(KimiK2Line(), path, block_size)
    assert isinstance(model, KimiK2ForCausalLM)
    return model


def load_hf(path: Path) -> transformers.DeepseekV3ForCausalLM:
    """transformers' model of the checkpoint. Its config must say `deepseek_v3`: with
    `kimi_k2` transformers 5.23 leaves the per-expert tensors unread and the routed experts
    random, silently (kimi-glm.md 1.1), so every tensor is checked to be read."""
    config = transformers.DeepseekV3Config.from_pretrained(path)
    config.model_type = "deepseek_v3"
    hf, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        path, config=config, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    return hf.eval()


def wrap_as_k25(text_model: Path, out: Path) -> Path:
    """Checkpoint `text_model` in K2.5/K2.6's vision-language layout: its config (with any
    quantization_config) nested as `text_config`, its tensors under `language_model.`, beside
    vision tensors a text server leaves unread."""
    tensors = {
        f"language_model.{k}": v for k, v in load_file(text_model / "model.safetensors").items()
    }
    norm = tensors["language_model.model.norm.weight"]
    tensors |= {"vision_tower.patch_embed.weight": norm, "mm_projector.proj.0.weight": norm}
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.clone() for k, v in tensors.items()}, out / "model.safetensors")
    text = json.loads((text_model / "config.json").read_text())
    config = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
              "text_config": text, "vision_config": {"model_type": "moonvit"}}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return out
