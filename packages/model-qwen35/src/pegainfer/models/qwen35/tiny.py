"""Tiny random Qwen3.5 checkpoints in the real VLM layout: config.json with `text_config` and
a `vision_config`, the decoder's tensors under `model.language_model.`, a few vision tensors
beside them (which serving ignores), the multi-token-prediction layer under `mtp.` (the
speculative-decoding drafter), a working byte-level BPE tokenizer with Qwen's special tokens and
a ChatML template, and generation_config.json. For tests and tryouts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from pegainfer.core.text.tiny_tokenizer import write_tiny_tokenizer
from pegainfer.core.tiny import save_sharded
from pegainfer.models.qwen35.config import Qwen35Config

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image_pad|>"]
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
# The real template also renders images, tools and thinking; the tiny checkpoint needs turns.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def default_text_config(vocab_size: int, eos: int) -> dict[str, Any]:
    return {
        "model_type": "qwen3_5_text",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        # head_dim 64 and value heads of 64 are the smallest the CUDA kernels take.
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "attn_output_gate": True,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
        },
        "tie_word_embeddings": True,
        "mtp_num_hidden_layers": 1,
        "eos_token_id": eos,
        "dtype": "float32",
    }


def random_weights(
    cfg: Qwen35Config, seed: int, std: float = 0.1, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Hugging Face-named tensors in the VLM layout, drawn on `device`; norms, A_log and
    dt_bias are spread out so that misusing them shows."""
    g = torch.Generator(device).manual_seed(seed)

    def normal(*shape: int, mean: float = 0.0, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device) * scale + mean

    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    root = "model.language_model."
    tensors = {root + "embed_tokens.weight": normal(cfg.vocab_size, h, scale=0.3)}

    def layer_tensors(p: str, kind: str) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        if kind == "full_attention":
            tensors |= {
                p + "self_attn.q_proj.weight": normal(2 * cfg.num_heads * d, h),
                p + "self_attn.k_proj.weight": normal(cfg.num_kv_heads * d, h),
                p + "self_attn.v_proj.weight": normal(cfg.num_kv_heads * d, h),
                p + "self_attn.o_proj.weight": normal(h, cfg.num_heads * d),
                p + "self_attn.q_norm.weight": normal(d),
                p + "self_attn.k_norm.weight": normal(d),
            }
        else:
            c = cfg.conv_channels
            tensors |= {
                p + "linear_attn.in_proj_qkv.weight": normal(c, h),
                p + "linear_attn.in_proj_z.weight": normal(hv * dv, h),
                p + "linear_attn.in_proj_b.weight": normal(hv, h),
                p + "linear_attn.in_proj_a.weight": normal(hv, h),
                p + "linear_attn.conv1d.weight": normal(c, 1, cfg.conv_kernel, scale=0.5),
                p + "linear_attn.A_log": torch.empty(hv, device=device)
                .uniform_(0.01, 16, generator=g)
                .log(),
                p + "linear_attn.dt_bias": normal(hv, mean=1.0, scale=0.3),
                p + "linear_attn.norm.weight": normal(dv, mean=1.0),
                p + "linear_attn.out_proj.weight": normal(h, hv * dv),
            }
        tensors |= {
            p + "input_layernorm.weight": normal(h),
            p + "post_attention_layernorm.weight": normal(h),
            p + "mlp.gate_proj.weight": normal(i, h),
            p + "mlp.up_proj.weight": normal(i, h),
            p + "mlp.down_proj.weight": normal(h, i),
        }
        return tensors

    for layer, kind in enumerate(cfg.layer_types):
        tensors |= layer_tensors(f"{root}layers.{layer}.", kind)
    tensors[root + "norm.weight"] = normal(h)
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = normal(cfg.vocab_size, h, scale=0.3)
    # Present in real checkpoints, never read when serving text.
    tensors["model.visual.patch_embed.proj.weight"] = normal(32, 3, 2, 16, 16)
    # The MTP layers (vLLM's qwen3_5_mtp.py names): read only with speculative decoding.
    for layer in range(cfg.mtp_num_hidden_layers):
        tensors |= layer_tensors(f"mtp.layers.{layer}.", "full_attention")
    if cfg.mtp_num_hidden_layers:
        tensors |= {"mtp.fc.weight": normal(h, 2 * h), "mtp.norm.weight": normal(h),
                    "mtp.pre_fc_norm_embedding.weight": normal(h),
                    "mtp.pre_fc_norm_hidden.weight": normal(h)}  # fmt: skip
    return tensors


def write_tiny_qwen35(
    out_dir: Path, *, seed: int = 0, num_shards: int = 1, device: str = "cpu", **overrides: Any
) -> None:
    """Write the checkpoint; `device` is where the random weights are drawn (a GPU is much
    faster at real sizes), `overrides` replace fields of `text_config`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_tiny_tokenizer(
        out_dir,
        special_tokens=SPECIAL_TOKENS,
        added_tokens=ADDED_TOKENS,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    endoftext, im_end = tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_end|>")
    vocab_size = -(-tokenizer.get_vocab_size() // 64) * 64
    text = default_text_config(vocab_size, eos=endoftext) | overrides
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": {
            "model_type": "qwen3_5_vision",
            "depth": 1,
            "hidden_size": 32,
            "num_heads": 2,
            "out_hidden_size": text["hidden_size"],
        },
        "image_token_id": tokenizer.token_to_id("<|image_pad|>"),
        "tie_word_embeddings": text["tie_word_embeddings"],
        "eos_token_id": im_end,
    }
    dtype = getattr(torch, text["dtype"])
    tensors = random_weights(Qwen35Config.from_dict(config), seed, device=device)
    tensors = {n: t.to(dtype) for n, t in tensors.items()}
    save_sharded(tensors, out_dir, num_shards)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"eos_token_id": [im_end, endoftext], "pad_token_id": endoftext,
                  "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}  # fmt: skip
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
