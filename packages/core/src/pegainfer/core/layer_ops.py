"""The element-wise layer ops every line uses: fused residual add + RMSNorm and SiLU-and-mul,
as Triton kernels on CUDA (`core.kernels`) or their torch references elsewhere (`core.ops`,
which follow transformers' casts)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pegainfer.core.ops import activation, rms_norm


@dataclass(frozen=True)
class LayerOps:
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]


def layer_ops(device: torch.device) -> LayerOps:
    if device.type != "cuda":
        return LayerOps(rms_norm.add_rms_norm, activation.silu_and_mul)
    from pegainfer.core.kernels import activation as fast_activation
    from pegainfer.core.kernels import norm as fast_norm

    return LayerOps(fast_norm.add_rms_norm, fast_activation.silu_and_mul)
