"""Tiny random Kimi-K2 checkpoints in the real layout (Kimi-K2-Instruct's structure at a small
size: q-LoRA MLA, YaRN with equal mscales, a dense first layer, noaux_tc routing with a float32
correction bias, one shared expert; experts one by one), with the tiny tokenizer in Kimi's real
format (`tiny_tokenizer`). For tests and tryouts; `overrides` reach any width, depth and expert
count (the benchmarks' real-width checkpoints), and a `quantization_config` override stores the
linear layers as it says (Kimi-K2-Instruct's FP8 blocks, K2-Thinking's INT4 experts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pegainfer.core.latent_moe.random_weights import quantize_linear_layers, random_weights
from pegainfer.core.quant.scheme import parse_quantization
from pegainfer.core.tiny import save_sharded
from pegainfer.models.kimi_k2.config import KimiCheckpoint
from pegainfer.models.kimi_k2.tiny_tokenizer import SPECIAL_OFFSETS, write_tiny_kimi_tokenizer
from pegainfer.models.kimi_k2.tokenizer import NUM_RESERVED_SPECIAL_TOKENS


def default_config(vocab_size: int, bos: int, eos: int) -> dict[str, Any]:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 48,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.827,
        "num_nextn_predict_layers": 0,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def write_tiny_kimi(
    out_dir: Path, *, seed: int = 0, num_shards: int = 1, device: str = "cpu",
    weights: bool = True, thinking: bool = True, **overrides: Any,
) -> None:  # fmt: skip
    """Write the checkpoint; `device` is where the random weights are drawn (a GPU is much
    faster at real sizes), `overrides` replace config.json fields. `weights` False: config and
    tokenizer only, for `--load-format dummy`, which draws the weights in place. `thinking`:
    K2-Thinking's chat template (False: K2-Instruct's)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tiny_kimi_tokenizer(out_dir, thinking=thinking)  # and generation_config
    base = vocab_size - NUM_RESERVED_SPECIAL_TOKENS
    bos, eos = base + SPECIAL_OFFSETS["[BOS]"], base + SPECIAL_OFFSETS["[EOS]"]
    config = default_config(-(-vocab_size // 64) * 64, bos=bos, eos=eos) | overrides
    checkpoint = KimiCheckpoint.of(config)
    if isinstance(checkpoint, str):
        raise ValueError(checkpoint)
    cfg, scheme = checkpoint.model_config(), parse_quantization(config)
    if weights:
        dtype = getattr(torch, config["torch_dtype"])
        tensors = random_weights(cfg, seed, device=device, dtype=dtype)
        if scheme is not None:
            tensors = quantize_linear_layers(tensors, scheme)
        save_sharded(tensors, out_dir, num_shards)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
