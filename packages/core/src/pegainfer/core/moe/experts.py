"""A rank's routed experts as one typed object, and their weighted sum (the torch reference;
CUDA: the fused Triton MoE of `moe.kernels`).

`ExpertWeights` is what the MoE layer hands the compute: stacked SwiGLU weights of experts
`first`.. `first + count - 1`. A quantized layout (FP8 blocks, INT4 groups) is a subclass that
carries its scales and overrides `apply` (its kernels and its dequantizing reference); the
layer, routing and expert parallelism do not change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
        if x.is_cuda:
            from pegainfer.core.moe.kernels import fused_moe

            return fused_moe(x, weights, experts, self.gate_up, self.down, self.first, shared)
        routed = moe(x, weights, experts, self.gate_up, self.down, self.first)
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
    out = torch.zeros_like(x)
    for expert in experts.unique().tolist():
        local = expert - first
        if not 0 <= local < gate_up.shape[0]:
            continue
        token, slot = (experts == expert).nonzero(as_tuple=True)
        gate, up = F.linear(x[token], gate_up[local]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[local]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out
