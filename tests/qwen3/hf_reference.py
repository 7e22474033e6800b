"""Tiny random Qwen3 checkpoints written by transformers, and both models loaded from them."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from pegainfer.models.qwen3.line import Qwen3Line
from pegainfer.models.qwen3.model import Qwen3ForCausalLM
from tests.paged_runner import load_model

VOCAB = 256


def write_hf_checkpoint(path: Path, *, tie: bool, seed: int = 0, layers: int = 2) -> Path:
    """Save a random `Qwen3ForCausalLM` with norms moved away from 1 and peaked logits."""
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=tie,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    model.save_pretrained(path)
    return path


def load_ours(path: Path, block_size: int = 4) -> Qwen3ForCausalLM:
    model = load_model(Qwen3Line(), path, block_size)
    assert isinstance(model, Qwen3ForCausalLM)
    return model


def load_hf(path: Path) -> transformers.Qwen3ForCausalLM:
    return transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
