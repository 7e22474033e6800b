"""Qwen3's config.json, parsed into the fields the forward pass uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pegainfer.core.errors import ConfigError


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Qwen3Config:
        """Parse and refuse the variants this line does not implement (rather than ignore them)."""
        try:
            num_heads = int(config["num_attention_heads"])
            hidden_size = int(config["hidden_size"])
            rope = config.get("rope_parameters") or {}
            parsed = cls(
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
                head_dim=int(config.get("head_dim") or hidden_size // num_heads),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 1e6))),
                max_position_embeddings=int(config.get("max_position_embeddings", 40960)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"invalid Qwen3 config.json: {exc!r}") from exc
        rope_type = rope.get("rope_type", "default")
        if config.get("rope_scaling") or rope_type != "default":
            raise ConfigError("Qwen3 with RoPE scaling (YaRN) is not supported yet")
        if config.get("use_sliding_window"):
            raise ConfigError("Qwen3 with sliding-window attention is not supported")
        if config.get("attention_bias"):
            raise ConfigError("Qwen3 with attention biases is not supported")
        if parsed.num_heads % parsed.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({parsed.num_heads}) must be a multiple of "
                f"num_key_value_heads ({parsed.num_kv_heads})"
            )
        return parsed
