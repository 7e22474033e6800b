"""Qwen3.5's text configuration, read from a VLM checkpoint's `text_config` or a text-only one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pegainfer.core.errors import ConfigError

FULL, LINEAR = "full_attention", "linear_attention"


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's settings: nested under `text_config` in `qwen3_5` (VLM) checkpoints."""
    if config.get("model_type") == "qwen3_5":
        nested = config.get("text_config")
        if not isinstance(nested, dict):
            raise ConfigError("a qwen3_5 config.json needs a text_config object")
        return nested
    return config


@dataclass(frozen=True)
class Qwen35Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    #: Multi-token-prediction layers (`mtp.*`), the speculative-decoding drafter.
    mtp_num_hidden_layers: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def full_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == FULL]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind == LINEAR]

    @property
    def conv_channels(self) -> int:
        """Channels of the DeltaNet's conv: q, k and v."""
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        return 2 * key_dim + self.linear_num_value_heads * self.linear_value_head_dim

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Qwen35Config:
        text = text_config(config)
        layers = int(text["num_hidden_layers"])
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
        if len(layer_types) != layers or not set(layer_types) <= {FULL, LINEAR}:
            raise ConfigError(f"layer_types must list {layers} of {FULL!r}/{LINEAR!r}")
        if not text.get("attn_output_gate", True):
            raise ConfigError("only Qwen3.5's gated attention (attn_output_gate true) is supported")
        rope = text.get("rope_parameters") or {}
        head_dim = int(text.get("head_dim", 256))
        partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"rope_type {rope['rope_type']!r} is not supported")
        tie = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
        return cls(
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]),
            layer_types=tuple(layer_types),
            num_heads=int(text["num_attention_heads"]),
            num_kv_heads=int(text["num_key_value_heads"]),
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10_000.0))),
            linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(tie),
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0)),
        )
