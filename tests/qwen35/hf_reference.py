"""Tiny random Qwen3.5 checkpoints in the real (VLM) layout, written by transformers."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from pegainfer.models.qwen35.line import Qwen35Line
from pegainfer.models.qwen35.model import Qwen35ForCausalLM
from tests.paged_runner import load_model

VOCAB = 300
TEXT = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                            "partial_rotary_factor": 0.25}}  # fmt: skip
VISION = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
          "out_hidden_size": 64}  # fmt: skip


def write_hf_checkpoint(path: Path, *, tie: bool, seed: int = 0) -> Path:
    """A `Qwen3_5ForConditionalGeneration` (keys under model.language_model., a vision tower
    beside) with every norm, A_log and dt_bias moved away from its initial value."""
    config = transformers.Qwen3_5Config(
        text_config=TEXT | {"tie_word_embeddings": tie}, vision_config=VISION,
        tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("linear_attn.norm.weight"):  # used as is: around 1
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("norm.weight"):  # used as 1 + w: around 0
                param.copy_(0.1 * torch.randn_like(param))
            elif name.endswith(("A_log", "dt_bias")):
                param.add_(0.3 * torch.randn_like(param))
            elif name.endswith("conv1d.weight"):
                param.mul_(3.0)
    model.save_pretrained(path)
    return path


def load_ours(path: Path, block_size: int = 4) -> Qwen35ForCausalLM:
    model = load_model(Qwen35Line(), path, block_size)
    assert isinstance(model, Qwen35ForCausalLM)
    return model


def load_hf(path: Path) -> transformers.Qwen3_5ForCausalLM:
    return transformers.Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
