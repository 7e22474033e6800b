"""RoPE on interleaved pairs (x0, x1), (x2, x3), ... with YaRN's context extension, as
DeepSeek-V2/V3, Kimi-K2 and GLM-5 rotate MLA's rope dims (transformers' complex
multiplication, in float32).

transformers' DeepSeek-V3 writes the rotated pairs de-interleaved ([evens' | odds']) for both q
and k; we keep them in place. Dot products are the same either way (one permutation on both
sides), so the cached keys differ from transformers' by that permutation only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from pegainfer.core.errors import ConfigError


@dataclass(frozen=True)
class Rope:
    """RoPE over the `dim` rotary dims of q and k, with YaRN's context extension when
    `factor` > 1."""

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
        """What cos and sin are scaled by (1 for DeepSeek and Kimi, whose two mscales are
        equal)."""
        if not self.yarn:
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return self._mscale(self.factor, self.mscale) / self._mscale(
                self.factor, self.mscale_all_dim
            )
        return self._mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """The factor YaRN puts on the softmax scale, squared (transformers' yarn_apply_mscale;
        DeepSeek-V3's `mscale_all_dim`)."""
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


def inv_freq(rope: Rope) -> torch.Tensor:
    """transformers' default or YaRN inverse frequencies for `rope.dim` rotary dims."""
    dim = rope.dim
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if not rope.yarn:
        return 1.0 / pos_freqs

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_positions / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * (
        extrapolation
    )


class InterleavedRope:
    """cos/sin tables [max_positions, dim / 2] (float32), scaled by YaRN's attention factor."""

    def __init__(self, rope: Rope, max_positions: int, device: torch.device) -> None:
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq(rope))
        self.cos = (freqs.cos() * rope.attention_factor).to(device)
        self.sin = (freqs.sin() * rope.attention_factor).to(device)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [tokens, heads, dim] by cos/sin [tokens, dim / 2],
    in float32."""
    cos, sin = cos[:, None], sin[:, None]
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)
