"""A skinny GEMM for decode steps: y = x @ wᵀ for a few rows of x (Triton; reference:
`torch.nn.functional.linear`).

At a decode batch of one to a few sequences a linear layer is a stream over its weight: 2 bytes
per multiply-add at one row. cuBLAS reads Qwen3-4B's weights at 81% of an H200's copy rate at
one sequence (issue 19's profile), in kernels that split K and reduce in a second launch. Here
each program owns `block_n` output columns over the whole of K, so one launch writes y and the
weight is read once, in `block_k`-wide tiles that Triton pipelines `num_stages` deep: with a
few thousand columns that is hundreds of programs, all resident at once, enough loads in flight
to keep HBM busy without splitting K. The few rows of x are padded to one 16-row MMA tile (they
come from L2: every program reads them) and the products accumulate in fp32.

`gated` takes x = [gate | up] and multiplies silu(gate) * up (with `ops.activation`'s casts)
as it loads each tile: an MLP's down projection without the SiLU-and-mul launch before it.

`benchmarks/decode_kernels.py` times it against cuBLAS at each layer's shape; it is not wired
into the model until that shows it faster.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

#: Rows of x one launch takes: one MMA tile.
MAX_ROWS = 16


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 32
    block_k: int = 256
    num_stages: int = 4
    num_warps: int = 4


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    GATED: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    # Out-of-range columns read row N - 1 again (never stored): loads stay unmasked along N.
    rn_load = tl.minimum(rn, N - 1)
    w_ptrs = w_ptr + rn_load[:, None] * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    m_mask = rm[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            w = tl.load(w_ptrs)
            x_mask = m_mask
        else:
            k_mask = (k * BLOCK_K + rk)[None, :] < K
            w = tl.load(w_ptrs, mask=k_mask, other=0.0)
            x_mask = m_mask & k_mask
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        if GATED:  # x holds the gates; the ups sit K columns on
            gate = x.to(tl.float32)
            up = tl.load(x_ptrs + K, mask=x_mask, other=0.0)
            # torch rounds silu(gate) to the input dtype before the product; so do we.
            act = (gate * tl.sigmoid(gate)).to(x_ptr.dtype.element_ty).to(tl.float32)
            x = (act * up.to(tl.float32)).to(x_ptr.dtype.element_ty)
        acc = tl.dot(x, tl.trans(w), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask & (rn[None, :] < N))


@cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(n: int, sms: int) -> GemvConfig:
    """32 columns a program where that still gives each of `sms` SMs two programs, else 16.
    (A 32 x 256 weight tile with x's 16 x 256, four stages deep, takes 96 KiB of shared
    memory: two programs fit an SM.)"""
    return GemvConfig(block_n=32 if triton.cdiv(n, 32) >= 2 * sms else 16)


def gemv(
    x: torch.Tensor, w: torch.Tensor, config: GemvConfig | None = None, *, gated: bool = False
) -> torch.Tensor:
    """`F.linear(x, w)` for x [M, K] with M <= MAX_ROWS and w [N, K], both K-contiguous and of
    one dtype; y [M, N] in that dtype, accumulated in fp32. `gated`: x is [M, 2K], [gate | up],
    and y is `F.linear(silu_and_mul(x), w)`."""
    width = x.shape[-1] // 2 if gated else x.shape[-1]
    if x.dim() != 2 or w.dim() != 2 or width != w.shape[1] or (gated and x.shape[1] % 2):
        wanted = "[M, 2K]" if gated else "[M, K]"
        raise ValueError(
            f"gemv takes x {wanted} and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    m, k = x.shape[0], width
    n = w.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv takes 1 to {MAX_ROWS} rows, got {m}")
    if x.dtype != w.dtype:
        raise ValueError(f"gemv takes x and w of one dtype, got {x.dtype} and {w.dtype}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("gemv takes x and w contiguous along K")
    config = config or default_config(n, _sm_count(x.device))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x,
        w,
        y,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        BLOCK_M=MAX_ROWS,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0,
        GATED=gated,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return y
