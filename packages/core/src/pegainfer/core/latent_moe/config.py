"""The configuration of a latent-attention MoE decoder (DeepSeek-V2 / V3 style): MLA with an
optional q LoRA, YaRN RoPE, dense first layers, routed and shared experts (models.md sections
2.3 and 2.4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pegainfer.core.errors import ConfigError
from pegainfer.core.moe.routing import Routing
from pegainfer.core.ops.interleaved_rope import Rope


@dataclass(frozen=True)
class LatentMoEConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int  # the dense layers' MLP
    moe_intermediate_size: int
    num_shared_experts: int
    first_k_dense_replace: int
    routing: Routing
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: Rope
    # DeepSeek-V3's multi-token-prediction layers, stored after the decoder's (not run yet).
    mtp_layers: int = 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * self.rope.softmax_mscale

    @property
    def num_experts(self) -> int:
        return self.routing.num_experts

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> LatentMoEConfig:
        if config.get("moe_layer_freq", 1) != 1:
            raise ConfigError("only moe_layer_freq 1 is supported")
        rope_dim = int(config["qk_rope_head_dim"])
        routing = Routing.from_dict(config)
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=int(config["num_attention_heads"]),
            q_lora_rank=config.get("q_lora_rank"),
            kv_lora_rank=int(config["kv_lora_rank"]),
            qk_nope_head_dim=int(config["qk_nope_head_dim"]),
            qk_rope_head_dim=rope_dim,
            v_head_dim=int(config["v_head_dim"]),
            intermediate_size=int(config["intermediate_size"]),
            moe_intermediate_size=int(config["moe_intermediate_size"]),
            num_shared_experts=int(config.get("n_shared_experts") or 0),
            first_k_dense_replace=int(config.get("first_k_dense_replace", 0)),
            routing=routing,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config["max_position_embeddings"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope=Rope.from_dict(config, rope_dim),
            mtp_layers=int(config.get("num_nextn_predict_layers") or 0),
        )
