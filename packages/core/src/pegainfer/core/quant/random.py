"""Random weights stored quantized, drawn in place on any device: for kernel tests, benchmarks
and real-size random checkpoints, where drawing full-precision weights first and quantizing
them would need several times the memory (Kimi-K2's experts are 1 T parameters)."""

from __future__ import annotations

import math

import torch

from pegainfer.core.ops.quant import FP8, FP8_MAX
from pegainfer.core.quant.scheme import Fp8Block, Int4Group, WeightFormat

# Uniform nibbles -8..7: the standard deviation of an INT4 weight before its scale.
_INT4_STD = math.sqrt((16**2 - 1) / 12)
# FP8 values are drawn with this standard deviation (well inside e4m3's +-448, away from its
# subnormals), and their scales bring them to the asked one.
_FP8_STD = 100.0


def random_quantized(
    fmt: WeightFormat,
    shape: tuple[int, ...],
    std: float,
    generator: torch.Generator,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored tensors (weight, scales) of random weights of `shape` ([..., N, K], a stack
    of matrices) in `fmt`, whose dequantized entries have a standard deviation of about `std`
    (each scale jittered by x0.5 .. x1.5, so that the scales matter). Drawn matrix by matrix:
    the temporaries stay one matrix in float32."""
    *stack, rows, cols = shape
    if isinstance(fmt, Fp8Block):
        weight = torch.empty(*stack, rows, cols, dtype=FP8, device=device)
        for matrix in weight.view(-1, rows, cols):
            sample = torch.randn(rows, cols, generator=generator, device=device) * _FP8_STD
            matrix.copy_(sample.clamp(-FP8_MAX, FP8_MAX))
        scale_shape = (*stack, *fmt.parts[1].shape(rows, cols))
        unit = std / _FP8_STD
    elif isinstance(fmt, Int4Group):
        # Every bit pattern of an int32 is eight valid nibbles.
        weight = torch.randint(-(2**31), 2**31 - 1, (*stack, rows, cols // 8), dtype=torch.int32,
                               generator=generator, device=device)  # fmt: skip
        scale_shape = (*stack, rows, cols // fmt.group_size)
        unit = std / _INT4_STD
    else:
        raise TypeError(f"unknown weight format {fmt!r}")
    jitter = torch.rand(scale_shape, generator=generator, device=device) + 0.5
    scale_dtype = fmt.parts[1].dtype
    return weight, (jitter * unit).to(scale_dtype)
