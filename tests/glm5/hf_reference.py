"""Tiny random GLM-5 checkpoints written by transformers (`GlmMoeDsaForCausalLM`, the
published layout: per-expert tensors, the indexer's, the router's float32 correction bias),
optionally with an MTP layer's tensors (`model.layers.{num_hidden_layers}.*`), and both models
loaded from them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from pegainfer.models.glm5.line import Glm5Line
from pegainfer.models.glm5.model import Glm5ForCausalLM
from tests.paged_runner import load_model

VOCAB = 300
# GLM-5's structure at a small size: q-LoRA, nope != value, 3 dense layers then MoE with a
# shared expert and noaux_tc routing; the indexer's real 32 heads (fewer make ReLU's exact-0
# score ties: top-k then depends on row length) and a top-k below the test lengths.
SMALL = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
         "moe_intermediate_size": 32, "num_hidden_layers": 5, "num_attention_heads": 4,
         "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32,
         "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 24,
         "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
         "first_k_dense_replace": 3, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
         "routed_scaling_factor": 2.5, "index_n_heads": 32, "index_head_dim": 16,
         "index_topk": 8, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
         "tie_word_embeddings": False}  # fmt: skip


def write_hf_checkpoint(path: Path, *, seed: int = 0, mtp: bool = False, **overrides) -> Path:
    """A random `GlmMoeDsaForCausalLM` with every norm, the indexer's LayerNorm bias and the
    router's correction bias moved away from transformers' 1 / 0, and a router spread enough
    that tokens pick different experts. `mtp`: append an MTP layer's tensors, as GLM-5's
    checkpoints carry one (transformers ignores them)."""
    config = transformers.GlmMoeDsaConfig(**(SMALL | overrides), initializer_range=0.1,
                                          bos_token_id=None, eos_token_id=None)  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.GlmMoeDsaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("k_norm.bias"):
                param.copy_(0.1 * torch.randn_like(param))
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0, 1.0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    model.save_pretrained(path)
    if mtp:
        _append_mtp_layer(path, config.num_hidden_layers)
    return path


def _append_mtp_layer(path: Path, layer: int) -> None:
    """The last layer's tensors again as `model.layers.{layer}.*`, with the MTP head's own."""
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(9)
    last = f"model.layers.{layer - 1}."
    extra = {name.replace(last, f"model.layers.{layer}.", 1): torch.randn(t.shape, generator=g)
             for name, t in tensors.items() if name.startswith(last)}  # fmt: skip
    h = tensors["model.norm.weight"].shape[0]
    for leaf, shape in (("enorm.weight", (h,)), ("hnorm.weight", (h,)),
                        ("eh_proj.weight", (h, 2 * h)), ("shared_head.norm.weight", (h,)),
                        ("shared_head.head.weight", tensors["lm_head.weight"].shape)):  # fmt: skip
        extra[f"model.layers.{layer}.{leaf}"] = torch.randn(shape, generator=g)
    save_file(tensors | extra, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))


def load_ours(path: Path, block_size: int = 4) -> Glm5ForCausalLM:
    model = load_model(Glm5Line(), path, block_size)
    assert isinstance(model, Glm5ForCausalLM)
    return model


def load_hf(path: Path) -> transformers.GlmMoeDsaForCausalLM:
    return transformers.GlmMoeDsaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
