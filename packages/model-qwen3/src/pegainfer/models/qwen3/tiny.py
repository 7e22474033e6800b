"""Tiny random Qwen3 checkpoints in the real layout: Hugging Face key names, config.json,
a working byte-level BPE tokenizer with Qwen3's special tokens and chat template, and
generation_config.json. Used by the tests and by anyone trying pegainfer without a download.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from pegainfer.core.text.tiny_tokenizer import write_tiny_tokenizer
from pegainfer.core.tiny import save_sharded
from pegainfer.models.qwen3.config import Qwen3Config

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Real Qwen3 keeps these as added tokens that are not "special" (they survive decoding).
ADDED_TOKENS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]


def default_config(vocab_size: int, bos: int, eos: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        # head_dim 64 is the smallest the CUDA attention kernels take, so the tiny model
        # also runs on a GPU.
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def random_weights(
    cfg: Qwen3Config, seed: int, std: float = 0.1, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Hugging Face-named tensors; norm weights are perturbed away from 1 so misuse shows.

    The scales give next-token logits a spread of a few nats: peaked enough that greedy
    decoding has no near-ties, flat enough that sampling still varies.
    """
    g = torch.Generator(device).manual_seed(seed)

    def normal(*shape: int, mean: float = 0.0, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device) * scale + mean

    def norm(size: int) -> torch.Tensor:
        return normal(size, mean=1.0, scale=0.1)

    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    tensors = {"model.embed_tokens.weight": normal(cfg.vocab_size, h, scale=0.3)}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "input_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": normal(cfg.num_heads * d, h),
            p + "self_attn.k_proj.weight": normal(cfg.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": normal(cfg.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": normal(h, cfg.num_heads * d),
            p + "self_attn.q_norm.weight": norm(d),
            p + "self_attn.k_norm.weight": norm(d),
            p + "post_attention_layernorm.weight": norm(h),
            p + "mlp.gate_proj.weight": normal(i, h),
            p + "mlp.up_proj.weight": normal(i, h),
            p + "mlp.down_proj.weight": normal(h, i),
        }
    tensors["model.norm.weight"] = norm(h)
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = normal(cfg.vocab_size, h, scale=0.3)
    return tensors


def write_tiny_qwen3(
    out_dir: Path, *, seed: int = 0, num_shards: int = 1, device: str = "cpu", **overrides: Any
) -> None:
    """Write the checkpoint; `device` is where the random weights are drawn (a GPU is much
    faster at real sizes), `overrides` replace config.json fields."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    template = resources.files("pegainfer.models.qwen3").joinpath("chat_template.jinja")
    write_tiny_tokenizer(
        out_dir,
        special_tokens=SPECIAL_TOKENS,
        added_tokens=ADDED_TOKENS,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=template.read_text(),
    )
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    endoftext, im_end = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_end|>")
    # Like the real checkpoints, the embedding has more rows than the tokenizer has tokens.
    vocab_size = -(-tokenizer.get_vocab_size() // 64) * 64
    config = default_config(vocab_size, bos=endoftext, eos=im_end) | overrides
    dtype = getattr(torch, config["torch_dtype"])
    tensors = random_weights(Qwen3Config.from_dict(config), seed, device=device)
    tensors = {n: t.to(dtype) for n, t in tensors.items()}
    save_sharded(tensors, out_dir, num_shards)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    write_generation_config(out_dir, endoftext=endoftext, im_end=im_end)


def write_generation_config(out_dir: Path, *, endoftext: int, im_end: int) -> None:
    """Qwen3's generation_config.json: stop on <|im_end|> or <|endoftext|>, sample as Qwen
    recommends for thinking mode."""
    generation = {
        "bos_token_id": endoftext,
        "eos_token_id": [im_end, endoftext],
        "pad_token_id": endoftext,
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
