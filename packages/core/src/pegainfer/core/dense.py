"""How a line's MLP gate_up (with its activation) and LM head multiply: cuBLAS through
`quant.linear.linear` (the reference and the default), or, with `--small-batch-gemv` on CUDA,
the Triton GEMV of `core.kernels.gemv`, for steps of at most `gemv.MAX_ROWS` rows (the small
decode buckets).

Measured on one H200 at Qwen3-4B's shapes, one layer's call under a CUDA graph
(`benchmarks/decode_kernels.py`, docs/benchmarks/2026-12-01-engine-step-h200 run 7): the LM
head in 179 against cuBLAS's 215 us at one row (the GEMV at the copy rate), and the MLP's
gate_up with its SiLU-and-mul in the GEMV's epilogue in 28.4-30.0 against 30.2-31.2 us for
cuBLAS then the activation's kernel. The other layers (qkv, o, down: 20-50 MB each) stay on
cuBLAS, which was as fast or faster there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pegainfer.core.layer_ops import layer_ops
from pegainfer.core.quant.linear import Weight, linear

Linear = Callable[[torch.Tensor, Weight], torch.Tensor]


@dataclass(frozen=True)
class DenseOps:
    #: x [rows, in] by W = [gate; up] [2 * out, in]: silu(x gateᵀ) * (x upᵀ), [rows, out].
    gated: Linear
    #: x [rows, hidden] by the LM head [vocab, hidden].
    head: Linear


def dense_ops(device: torch.device, small_batch_gemv: bool = False) -> DenseOps:
    silu_and_mul = layer_ops(device).silu_and_mul

    def gated(x: torch.Tensor, weight: Weight) -> torch.Tensor:
        return silu_and_mul(linear(x, weight))

    if not small_batch_gemv:
        return DenseOps(gated, linear)
    if device.type != "cuda":
        raise ValueError("the small-batch GEMV is a CUDA kernel")
    from pegainfer.core.kernels.gemv import MAX_ROWS, GemvConfig, gemv

    # The tiles that measured fastest (run 7): 64 columns, 128 or 256 wide.
    gated_tiles, head_tiles = GemvConfig(64, 128, 4, 4), GemvConfig(64, 256, 3, 4)

    def takes(x: torch.Tensor, weight: Weight) -> bool:
        """A plain weight of x's dtype and few enough rows (quantized weights have their own
        GEMMs)."""
        return (isinstance(weight, torch.Tensor) and weight.dtype == x.dtype and x.dim() == 2
                and x.shape[0] <= MAX_ROWS and x.stride(1) == 1)  # fmt: skip

    def small_gated(x: torch.Tensor, weight: Weight) -> torch.Tensor:
        if takes(x, weight):
            return gemv(x, weight, gated_tiles, gated=True)
        return gated(x, weight)

    def small_head(x: torch.Tensor, weight: Weight) -> torch.Tensor:
        return gemv(x, weight, head_tiles) if takes(x, weight) else linear(x, weight)

    return DenseOps(small_gated, small_head)
