"""Random weights for a latent-attention MoE decoder, named and laid out as the published
checkpoints are (experts one by one, the router's correction bias in float32), optionally
stored as a `quantization_config` says (`quantize_linear_layers`): the tiny test checkpoints and
the benchmarks' real-width ones."""

from __future__ import annotations

import torch

from pegainfer.core.latent_moe.config import LatentMoEConfig
from pegainfer.core.ops.quant import quantize_fp8_block, quantize_int4_group
from pegainfer.core.quant.scheme import INT4_SHAPE_SUFFIX, Fp8Block, QuantScheme

# The decoder's linear layers as checkpoints name them (a quantization scheme's targets; norms,
# embeddings and the router are no linear layers of theirs).
LINEAR_LAYERS = frozenset({"q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                           "o_proj", "gate_proj", "up_proj", "down_proj"})  # fmt: skip


def random_weights(
    cfg: LatentMoEConfig,
    seed: int,
    std: float = 0.1,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Hugging Face-named tensors, experts one by one; norms away from 1, a spread router and
    correction bias (transformers initialises them to 1 and 0, which hides bugs). Each is drawn
    on `device` and kept in `dtype` (at real sizes, float32 copies of every tensor would not
    fit beside the result)."""
    g = torch.Generator(device).manual_seed(seed)

    def normal(*shape: int, mean: float = 0.0, scale: float = std) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * scale + mean).to(dtype)

    def mlp(prefix: str, inter: int) -> dict[str, torch.Tensor]:
        return {prefix + "gate_proj.weight": normal(inter, h), prefix + "up_proj.weight":
                normal(inter, h), prefix + "down_proj.weight": normal(h, inter)}  # fmt: skip

    def decoder_layer(layer: int) -> dict[str, torch.Tensor]:
        p = f"model.layers.{layer}."
        tensors: dict[str, torch.Tensor] = {}
        attn = p + "self_attn."
        q_out = heads * cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            tensors[attn + "q_proj.weight"] = normal(q_out, h)
        else:
            tensors |= {
                attn + "q_a_proj.weight": normal(cfg.q_lora_rank, h),
                attn + "q_a_layernorm.weight": normal(cfg.q_lora_rank, mean=1.0),
                attn + "q_b_proj.weight": normal(q_out, cfg.q_lora_rank),
            }
        tensors |= {
            p + "input_layernorm.weight": normal(h, mean=1.0),
            p + "post_attention_layernorm.weight": normal(h, mean=1.0),
            attn + "kv_a_proj_with_mqa.weight": normal(cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
            attn + "kv_a_layernorm.weight": normal(cfg.kv_lora_rank, mean=1.0),
            attn + "kv_b_proj.weight": normal(
                heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank
            ),
            attn + "o_proj.weight": normal(h, heads * cfg.v_head_dim),
        }
        if cfg.is_moe(layer):
            tensors[p + "mlp.gate.weight"] = normal(cfg.num_experts, h, scale=1.0)
            if cfg.routing.corrected:
                tensors[p + "mlp.gate.e_score_correction_bias"] = (
                    torch.randn(cfg.num_experts, generator=g, device=device) * 0.1
                )
            for e in range(cfg.num_experts):
                tensors |= mlp(f"{p}mlp.experts.{e}.", cfg.moe_intermediate_size)
            shared = cfg.moe_intermediate_size * cfg.num_shared_experts
            tensors |= mlp(f"{p}mlp.shared_experts.", shared)
        else:
            tensors |= mlp(f"{p}mlp.", cfg.intermediate_size)
        return tensors

    h, heads = cfg.hidden_size, cfg.num_heads
    tensors = {"model.embed_tokens.weight": normal(cfg.vocab_size, h, scale=0.3)}
    for layer in range(cfg.num_layers):
        tensors |= decoder_layer(layer)
    tensors["model.norm.weight"] = normal(h, mean=1.0)
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = normal(cfg.vocab_size, h, scale=0.3)
    # Multi-token-prediction layers after the decoder's (DeepSeek-V3's layout, GLM-5's): a
    # decoder layer, the norms of the token's embedding and of the hidden state before their
    # projection, and the layer's own LM head and its norm (drawn last: a checkpoint with them
    # has the same decoder weights as one without).
    for layer in range(cfg.num_layers, cfg.num_layers + cfg.mtp_layers):
        p = f"model.layers.{layer}."
        tensors |= decoder_layer(layer) | {
            p + "enorm.weight": normal(h, mean=1.0),
            p + "hnorm.weight": normal(h, mean=1.0),
            p + "eh_proj.weight": normal(h, 2 * h),
            p + "shared_head.norm.weight": normal(h, mean=1.0),
            p + "shared_head.head.weight": normal(cfg.vocab_size, h, scale=0.3),
        }
    return tensors


def quantize_linear_layers(
    tensors: dict[str, torch.Tensor], scheme: QuantScheme,
    layers: frozenset[str] = LINEAR_LAYERS,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """`tensors` with each linear layer's weight (`layers`: their last names; the decoder's
    by default) that `scheme` quantizes replaced by its stored tensors (FP8: `weight` and
    `weight_scale_inv`; INT4: `weight_packed`, `weight_scale` and `weight_shape`), quantized
    as the published checkpoints are."""
    out = {}
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        layer = module.rpartition(".")[2]
        fmt = scheme.format_for(module) if leaf == "weight" and layer in layers else None
        if fmt is None:
            out[name] = tensor
            continue
        if isinstance(fmt, Fp8Block):
            stored = quantize_fp8_block(tensor, fmt.block)
        else:
            stored = quantize_int4_group(tensor, fmt.group_size, fmt.scale_dtype)
            out[f"{module}.{INT4_SHAPE_SUFFIX}"] = torch.tensor(tensor.shape)
        for part, value in zip(fmt.parts, stored, strict=True):
            out[f"{module}.{part.suffix}"] = value
    return out
