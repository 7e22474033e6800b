"""Tiny random DeepSeek-V2 checkpoints written by transformers (per-expert tensors, as the
published ones), and both models loaded from them."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from pegainfer.core.latent_moe.model import LatentMoEForCausalLM
from pegainfer.models.deepseek.line import DeepseekLine
from tests.paged_runner import load_model

VOCAB = 300
# V2-Lite's structure at a small size: no q-LoRA, a dense first layer, 2 of 8 routed experts
# plus a shared one, YaRN with the published mscales.
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
         "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
         "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
         "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
         "q_lora_rank": None, "max_position_embeddings": 512, "topk_method": "greedy",
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}}  # fmt: skip


def write_hf_checkpoint(path: Path, *, seed: int = 0, **overrides) -> Path:
    """A random `DeepseekV2ForCausalLM` with norms moved away from 1 and a router spread
    enough that tokens pick different experts."""
    config = transformers.DeepseekV2Config(**(SMALL | overrides), initializer_range=0.1,
                                           bos_token_id=None, eos_token_id=None)  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.DeepseekV2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0, 1.0)
    model.save_pretrained(path)
    return path


def load_ours(path: Path, block_size: int = 4) -> LatentMoEForCausalLM:
    model = load_model(DeepseekLine(), path, block_size)
    assert isinstance(model, LatentMoEForCausalLM)
    return model


def load_hf(path: Path) -> transformers.DeepseekV2ForCausalLM:
    return transformers.DeepseekV2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
