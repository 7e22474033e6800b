"""A rank's routed experts as one typed object, and their weighted sum (the torch reference;
CUDA: the fused Triton MoE of `moe.kernels`).

`ExpertWeights` is what the MoE layer hands the compute: stacked SwiGLU weights of experts
`first`.. `first + count - 1`. A quantized layout (FP8 blocks, INT4 groups) is
`QuantizedExpertWeights`, which carries the scales and overrides `apply` (the fused kernels'
quantized variants, a dequantizing reference); the layer, routing and expert parallelism do not
change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pegainfer.core.kernels.dispatch import uses_cuda_kernels
from pegainfer.core.quant.linear import dequantize
from pegainfer.core.quant.scheme import WeightFormat


@dataclass(frozen=True)
class ExpertWeights:
    """gate_up [E, 2I, H] (each expert's gate rows, then its up rows) and down [E, H, I] of
    experts `first`.. `first + E - 1`."""

    gate_up: torch.Tensor
    down: torch.Tensor
    first: int = 0

    @property
    def count(self) -> int:
        return self.down.shape[0]

    def apply(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
        shared: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]) over the experts held here, plus
        `shared` [T, H] when given (pairs routed to other experts contribute nothing)."""
        if uses_cuda_kernels(x):
            from pegainfer.core.moe.kernels import fused_moe

            return fused_moe(x, weights, experts, self.gate_up, self.down, self.first, shared)
        routed = moe(x, weights, experts, self.gate_up, self.down, self.first)
        return routed if shared is None else routed + shared


@dataclass(frozen=True, kw_only=True)
class QuantizedExpertWeights(ExpertWeights):
    """Experts stored quantized as `fmt` says: `gate_up` / `down` as stored (FP8 e4m3 [E, 2I,
    H] / [E, H, I], or packed INT4 [E, 2I, H / 8] / [E, H, I / 8]) with their scales (FP8:
    [E, 2I / b0, ceil(H / b1)] and [E, H / b0, ceil(I / b1)]; INT4: [E, 2I, H / g] and
    [E, H, I / g]). CUDA: the fused MoE dequantizes each weight tile in the kernel (weight-only:
    FP8 x bf16, INT4 x bf16); elsewhere each chosen expert is dequantized exactly, then the
    reference runs."""

    gate_up_scale: torch.Tensor
    down_scale: torch.Tensor
    fmt: WeightFormat

    def apply(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
        shared: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if uses_cuda_kernels(x):
            from pegainfer.core.moe.kernels import fused_moe

            scales = (self.gate_up_scale, self.down_scale)
            return fused_moe(x, weights, experts, self.gate_up, self.down, self.first, shared,
                             scales=scales, fmt=self.fmt)  # fmt: skip

        def expert(local: int) -> tuple[torch.Tensor, torch.Tensor]:
            gate_up = dequantize(self.gate_up[local], self.gate_up_scale[local], self.fmt, x.dtype)
            return gate_up, dequantize(self.down[local], self.down_scale[local], self.fmt, x.dtype)

        routed = moe_by_expert(x, weights, experts, self.first, self.count, expert)
        return routed if shared is None else routed + shared


def moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    first: int = 0,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]), expert by expert (SwiGLU), over the
    experts held here: `gate_up[i]` [2I, H] and `down[i]` [H, I] are expert `first + i`'s
    (expert parallelism holds a range; the others' terms come from other ranks)."""
    return moe_by_expert(x, weights, experts, first, gate_up.shape[0],
                         lambda local: (gate_up[local], down[local]))  # fmt: skip


def moe_by_expert(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    first: int,
    count: int,
    expert: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """`moe` with each held expert's (gate_up [2I, H], down [H, I]) given by `expert(local)`,
    asked only for the experts some token chose."""
    out = torch.zeros_like(x)
    for chosen in experts.unique().tolist():
        local = chosen - first
        if not 0 <= local < count:
            continue
        token, slot = (experts == chosen).nonzero(as_tuple=True)
        gate_up, down = expert(local)
        gate, up = F.linear(x[token], gate_up).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out
