"""Tiny random GLM-5 checkpoints in the published layout (per-expert tensors, the indexer's,
the router's float32 correction bias; GLM-5's structure: q-LoRA MLA with nope != value, three
dense layers then MoE with sigmoid + correction-bias routing, 32 index heads and an
`index_topk` well below `max_model_len` so prompts of a few dozen tokens attend sparsely; with
`num_nextn_predict_layers` 1, GLM-5's MTP layer after them, the speculative drafter), with
a working byte-level BPE tokenizer with GLM's special and tool tokens, GLM-5's chat format
(`tiny_chat_template.jinja`) and its three end-of-turn tokens. For tests and tryouts.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from pegainfer.core.latent_moe.random_weights import (
    LINEAR_LAYERS,
    quantize_linear_layers,
    random_weights,
)
from pegainfer.core.quant.scheme import parse_quantization
from pegainfer.core.text.tiny_tokenizer import write_tiny_tokenizer
from pegainfer.core.tiny import save_sharded
from pegainfer.models.glm5.config import Glm5Config

SPECIAL_TOKENS = ["[gMASK]", "<|endoftext|>", "[MASK]", "[sMASK]", "<sop>", "<eop>",
                  "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]  # fmt: skip
# GLM's thinking and tool tags: kept when decoding with skip_special_tokens, so the parsers
# read them in the answer's text.
TAG_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
              "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
              "/nothink"]  # fmt: skip
# A turn ends where the model starts the next one (GLM-5's generation_config.json).
END_OF_TURN = ["<|endoftext|>", "<|user|>", "<|observation|>"]
# The indexer's linear layers a quantized checkpoint stores quantized (its head weights stay
# unquantized, as the model builds them).
INDEXER_LINEAR = frozenset({"wq_b", "wk"})


def default_config(vocab_size: int, bos: int, eos: int) -> dict[str, Any]:
    return {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 48,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "index_n_heads": 32,
        "index_head_dim": 32,
        "index_topk": 16,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def indexer_weights(
    cfg: Glm5Config, seed: int, std: float = 0.1, device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The indexers' tensors, as transformers names them (head weights in float32, the key
    norm away from transformers' 1 and 0): the decoder's full indexer layers', then the MTP
    layers' (each runs its own)."""
    g = torch.Generator(device).manual_seed(seed + 1)

    def normal(*shape: int, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device) * std + mean

    heads, dim = cfg.index_heads, cfg.index_head_dim
    tensors = {}
    mtp = range(cfg.num_layers, cfg.num_layers + cfg.mtp_layers)
    for layer in [*cfg.full_indexer_layers, *mtp]:
        p = f"model.layers.{layer}.self_attn.indexer."
        tensors |= {
            p + "wq_b.weight": normal(heads * dim, cfg.q_lora_rank).to(dtype),
            p + "wk.weight": normal(dim, cfg.hidden_size).to(dtype),
            p + "k_norm.weight": normal(dim, mean=1.0).to(dtype),
            p + "k_norm.bias": normal(dim).to(dtype),
            p + "weights_proj.weight": normal(heads, cfg.hidden_size),
        }
    return tensors


def write_tiny_glm5(
    out_dir: Path, *, seed: int = 0, num_shards: int = 1, device: str = "cpu",
    weights: bool = True, **overrides: Any,
) -> None:  # fmt: skip
    """Write the checkpoint; `device` is where the random weights are drawn (a GPU is much
    faster at real sizes), `overrides` replace config.json fields (a `quantization_config`
    stores the decoder's and the indexers' linear layers so: GLM-5-FP8's layout). `weights`
    False: config and tokenizer only, for `--load-format dummy`, which draws the weights in
    place."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    template = resources.files("pegainfer.models.glm5").joinpath("tiny_chat_template.jinja")
    write_tiny_tokenizer(
        out_dir,
        special_tokens=SPECIAL_TOKENS,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=template.read_text(encoding="utf-8"),
        added_tokens=TAG_TOKENS,
    )
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    bos, eos = (tokenizer.token_to_id(t) for t in SPECIAL_TOKENS[:2])
    generation = {"eos_token_id": [tokenizer.token_to_id(t) for t in END_OF_TURN]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    vocab_size = -(-tokenizer.get_vocab_size() // 64) * 64
    config = default_config(vocab_size, bos=bos, eos=eos) | overrides
    cfg, scheme = Glm5Config.from_dict(config), parse_quantization(config)
    if weights:
        dtype = getattr(torch, config["torch_dtype"])
        tensors = random_weights(cfg, seed, device=device, dtype=dtype)
        tensors |= indexer_weights(cfg, seed, device=device, dtype=dtype)
        if scheme is not None:
            tensors = quantize_linear_layers(tensors, scheme, LINEAR_LAYERS | INDEXER_LINEAR)
        save_sharded(tensors, out_dir, num_shards)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
