"""Tiny random DeepSeek-V2 checkpoints in the real layout (per-expert tensors, V2-Lite's
structure: no q-LoRA, a dense first layer, routed and shared experts, YaRN), with a working
byte-level BPE tokenizer and a plain chat template. For tests and tryouts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from pegainfer.core.latent_moe.random_weights import random_weights
from pegainfer.core.text.tiny_tokenizer import write_tiny_tokenizer
from pegainfer.core.tiny import save_sharded
from pegainfer.models.deepseek.line import deepseek_v2_config

SPECIAL_TOKENS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message.role == 'user' %}User: "
    "{{ message.content }}\n\n{% elif message.role == 'assistant' %}Assistant: "
    "{{ message.content }}{{ eos_token }}{% else %}{{ message.content }}\n\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def default_config(vocab_size: int, bos: int, eos: int) -> dict[str, Any]:
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": None,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "scoring_func": "softmax",
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def write_tiny_deepseek(
    out_dir: Path, *, seed: int = 0, num_shards: int = 1, device: str = "cpu",
    weights: bool = True, **overrides: Any,
) -> None:  # fmt: skip
    """Write the checkpoint; `device` is where the random weights are drawn (a GPU is much
    faster at real sizes), `overrides` replace config.json fields. `weights` False: config and
    tokenizer only, for `--load-format dummy`, which draws the weights in place."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_tiny_tokenizer(
        out_dir,
        special_tokens=SPECIAL_TOKENS,
        eos_token=SPECIAL_TOKENS[1],
        pad_token=SPECIAL_TOKENS[1],
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    bos, eos = (tokenizer.token_to_id(t) for t in SPECIAL_TOKENS)
    vocab_size = -(-tokenizer.get_vocab_size() // 64) * 64
    config = default_config(vocab_size, bos=bos, eos=eos) | overrides
    cfg = deepseek_v2_config(config)
    if weights:
        dtype = getattr(torch, config["torch_dtype"])
        tensors = random_weights(cfg, seed, device=device, dtype=dtype)
        save_sharded(tensors, out_dir, num_shards)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
