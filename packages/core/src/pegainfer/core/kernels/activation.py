"""Fused SiLU-and-mul (reference: `ops.activation.silu_and_mul`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(in_ptr, out_ptr, stride_in, stride_out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(in_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(in_ptr + row * stride_in + width + cols, mask=mask, other=0.0)
    # torch rounds silu(gate) to the input dtype before the product; so do we.
    act = (gate * tl.sigmoid(gate)).to(in_ptr.dtype.element_ty).to(tl.float32)
    out = act * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `gate_up` = [gate | up] along the last dimension."""
    width = gate_up.shape[-1] // 2
    x = gate_up.view(-1, 2 * width)
    out = torch.empty((x.shape[0], width), dtype=x.dtype, device=x.device)
    block = 1024
    grid = (x.shape[0], triton.cdiv(width, block))
    _silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), width, BLOCK=block)
    return out.view(*gate_up.shape[:-1], width)
