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

`gated` takes w = [gate; up] (an MLP's fused gate_up projection) and returns silu(x gateᵀ) *
(x upᵀ), with `ops.activation`'s casts: each program owns the same columns of both halves, so
the activation is its epilogue and the SiLU-and-mul launch after the projection goes away (in
the down projection's prologue instead, every program would recompute the whole activated row:
sigmoids of 16 padded rows per program, more than the SFUs keep up with).

`benchmarks/decode_kernels.py` times it against cuBLAS at each layer's shape. On an H200 at
Qwen3-4B's (docs/benchmarks/2026-12-01-engine-step-h200, run 7) it streams the LM head at the
copy rate (179 against cuBLAS's 215 us) and beats cuBLAS plus the activation's kernel on gate_up,
which `--small-batch-gemv` runs it for (`core.dense`); on the 20-50 MB qkv, o and down it is no
faster, down (2,560 columns over 9,728) the worst: 160 programs each streaming 311 KB alone.
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
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # GATED: the up half's columns
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs, mask=m_mask, other=0.0)
        else:
            k_mask = (k * BLOCK_K + rk)[None, :] < K
            w = tl.load(w_ptrs, mask=k_mask, other=0.0)
            x = tl.load(x_ptrs, mask=m_mask & k_mask, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        if GATED:  # the up rows sit N rows on
            if EVEN_K:
                w_up = tl.load(w_ptrs + N * stride_wn)
            else:
                w_up = tl.load(w_ptrs + N * stride_wn, mask=k_mask, other=0.0)
            acc_up = tl.dot(x, tl.trans(w_up), acc_up)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    dtype = y_ptr.dtype.element_ty
    if GATED:
        # As the reference: both halves rounded to the output dtype, silu(gate) rounded again
        # before the product.
        gate = acc.to(dtype).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        acc = act * acc_up.to(dtype).to(tl.float32)
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(dtype), mask=m_mask & (rn[None, :] < N))


@cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(n: int, sms: int, gated: bool = False) -> GemvConfig:
    """32 columns a program where that still gives each of `sms` SMs two programs, else 16;
    gated, 16 (of each half). (32 weight rows x 256 with x's 16 x 256, four stages deep, take
    96 KiB of shared memory: two programs fit an SM.)"""
    return GemvConfig(block_n=32 if not gated and triton.cdiv(n, 32) >= 2 * sms else 16)


def gemv(
    x: torch.Tensor, w: torch.Tensor, config: GemvConfig | None = None, *, gated: bool = False
) -> torch.Tensor:
    """`F.linear(x, w)` for x [M, K] with M <= MAX_ROWS and w [N, K], both K-contiguous and of
    one dtype; y [M, N] in that dtype, accumulated in fp32. `gated`: w is [2N, K] = [gate; up]
    and y [M, N] is `silu_and_mul(F.linear(x, w))`."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or (gated and w.shape[0] % 2):
        wanted = "[2N, K]" if gated else "[N, K]"
        raise ValueError(
            f"gemv takes x [M, K] and w {wanted}, got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    m, k = x.shape
    n = w.shape[0] // 2 if gated else w.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv takes 1 to {MAX_ROWS} rows, got {m}")
    if x.dtype != w.dtype:
        raise ValueError(f"gemv takes x and w of one dtype, got {x.dtype} and {w.dtype}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("gemv takes x and w contiguous along K")
    config = config or default_config(n, _sm_count(x.device), gated)
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
