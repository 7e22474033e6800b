"""A linear layer whose weight is stored quantized (`QuantLinear`), and the helpers that let a
model line treat plain and quantized weights alike (`linear_weight`, `linear`).

On the CPU the weight is dequantized exactly and multiplied in the activations' dtype: the
reference, and what transformers does on the CPU. On CUDA the Triton kernels of
`core.kernels.quant_gemm` run (weight-only for few rows, FP8 x FP8 for many: the reasons are
there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer.core.errors import ConfigError
from pegainfer.core.kernels.dispatch import uses_cuda_kernels
from pegainfer.core.loading.weights import empty_param
from pegainfer.core.ops import quant as ref
from pegainfer.core.quant.scheme import Fp8Block, Int4Group, WeightFormat


class QuantLinear(nn.Module):
    """y = x W^T for W [out_features, in_features] stored as `fmt` says: one parameter per
    stored tensor, named as the checkpoint names it (`weight` and `weight_scale_inv`, or
    `weight_packed` and `weight_scale`), so the loader fills them by suffix."""

    def __init__(self, out_features: int, in_features: int, fmt: WeightFormat) -> None:
        super().__init__()
        if isinstance(fmt, Int4Group) and in_features % fmt.group_size:
            raise ConfigError(
                f"INT4 weights need in_features ({in_features}) to be a multiple of the group "
                f"size {fmt.group_size}"
            )
        self.out_features, self.in_features, self.fmt = out_features, in_features, fmt
        for part in fmt.parts:
            shape = part.shape(out_features, in_features)
            self.register_parameter(part.suffix, empty_param(*shape, dtype=part.dtype))

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the quantized weight, its scales) as stored."""
        return tuple(getattr(self, part.suffix) for part in self.fmt.parts)  # type: ignore[return-value]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in `dtype`, exactly as stored (one rounding to `dtype`)."""
        return dequantize(*self.stored(), self.fmt, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if uses_cuda_kernels(x):
            from pegainfer.core.kernels import quant_gemm

            return quant_gemm.quant_linear(x, self)
        return F.linear(x, self.dequantize(x.dtype))

    def extra_repr(self) -> str:
        return f"{self.out_features}, {self.in_features}, {self.fmt.describe()}"


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, fmt: WeightFormat, dtype: torch.dtype
) -> torch.Tensor:
    """Stored weights [.., N, K] (packed INT4: [.., N, K / 8]) and their scales in `fmt`,
    dequantized exactly to `dtype` (the reference)."""
    if isinstance(fmt, Fp8Block):
        return ref.dequantize_fp8_block(weight, scale, fmt.block, dtype)
    return ref.dequantize_int4_group(weight, scale, fmt.group_size, dtype)


Weight = torch.Tensor | QuantLinear


def linear_weight(out_features: int, in_features: int, fmt: WeightFormat | None) -> Weight:
    """A line's weight [out, in]: a plain parameter in the model's dtype (fmt None) or a
    `QuantLinear` stored as `fmt` says. Either way the line's checkpoint name map targets it
    by the same name, and `linear` applies it."""
    if fmt is None:
        return empty_param(out_features, in_features)
    return QuantLinear(out_features, in_features, fmt)


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """x [.., in] W^T, W plain or quantized."""
    if isinstance(weight, QuantLinear):
        return weight(x)
    return F.linear(x, weight)
