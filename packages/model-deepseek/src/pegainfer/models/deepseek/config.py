"""DeepSeek-V2's configuration: multi-head latent attention, YaRN RoPE, routed and shared
experts (models.md section 2.3)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pegainfer.core.errors import ConfigError


@dataclass(frozen=True)
class Rope:
    """RoPE over the `dim` rotary dims of q and k (interleaved pairs), with YaRN's context
    extension when `factor` > 1."""

    dim: int
    theta: float
    factor: float = 1.0
    original_max_positions: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0

    @property
    def yarn(self) -> bool:
        return self.factor > 1.0

    @staticmethod
    def _mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    @property
    def attention_factor(self) -> float:
        """What cos and sin are scaled by (1 for DeepSeek, whose two mscales are equal)."""
        if not self.yarn:
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return self._mscale(self.factor, self.mscale) / self._mscale(
                self.factor, self.mscale_all_dim
            )
        return self._mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """The factor YaRN puts on the softmax scale, squared (transformers' yarn_apply_mscale)."""
        if not self.yarn or not self.mscale_all_dim:
            return 1.0
        return self._mscale(self.factor, self.mscale_all_dim) ** 2

    @classmethod
    def from_dict(cls, config: dict[str, Any], dim: int) -> Rope:
        # transformers 5 writes `rope_parameters`; the published checkpoints `rope_scaling`
        # beside a top-level `rope_theta`.
        params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        kind = params.get("rope_type", params.get("type", "default"))
        theta = float(params.get("rope_theta", config.get("rope_theta", 10_000.0)))
        if kind == "default":
            return cls(dim, theta)
        if kind != "yarn":
            raise ConfigError(f"rope type {kind!r} is not supported (default or yarn)")
        return cls(
            dim=dim,
            theta=theta,
            factor=float(params["factor"]),
            original_max_positions=int(params["original_max_position_embeddings"]),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            mscale=float(params.get("mscale") or 0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0),
        )


@dataclass(frozen=True)
class DeepseekConfig:
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
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    first_k_dense_replace: int
    topk_method: str
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: Rope

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * self.rope.softmax_mscale

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> DeepseekConfig:
        if config.get("scoring_func", "softmax") != "softmax":
            raise ConfigError("only softmax expert scoring is supported (DeepSeek-V2)")
        method = config.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(f"topk_method {method!r} is not supported")
        if config.get("moe_layer_freq", 1) != 1:
            raise ConfigError("only moe_layer_freq 1 is supported")
        rope_dim = int(config["qk_rope_head_dim"])
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
            num_experts=int(config["n_routed_experts"]),
            num_experts_per_tok=int(config["num_experts_per_tok"]),
            num_shared_experts=int(config.get("n_shared_experts") or 0),
            first_k_dense_replace=int(config.get("first_k_dense_replace", 0)),
            topk_method=method,
            n_group=int(config.get("n_group") or 1),
            topk_group=int(config.get("topk_group") or 1),
            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config["max_position_embeddings"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope=Rope.from_dict(config, rope_dim),
        )
