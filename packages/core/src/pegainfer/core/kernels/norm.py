"""Fused residual add + RMSNorm, with transformers' casts (reference: `ops.rms_norm`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTRED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)).to(
            x_ptr.dtype.element_ty
        )
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        out = xf * rstd * (1.0 + w)
    else:
        out = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    zero_centred: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual += x` (in place) then `rms_norm(residual)`; with no residual, `x` is it.

    Same contract as `ops.rms_norm.add_rms_norm`, but one pass over memory. The returned
    residual is `residual` itself (updated) or, on the first layer, `x`.
    """
    hidden = x.shape[-1]
    x2 = x.view(-1, hidden)
    out = torch.empty_like(x2)
    r2 = x2 if residual is None else residual.view(-1, hidden)
    _add_rms_norm_kernel[(x2.shape[0],)](
        x2,
        r2,
        weight,
        out,
        x2.stride(0),
        r2.stride(0),
        out.stride(0),
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        ZERO_CENTRED=zero_centred,
        BLOCK=triton.next_power_of_2(hidden),
        num_warps=8 if hidden >= 2048 else 4,
    )
    return out.view_as(x), (x if residual is None else residual)
