"""`x @ w.T` for a few rows of `x`: the GEMMs of small decode batches (reference: `F.linear`).

At batch 1-16 a decode step's GEMMs only stream their weights; cuBLAS runs these shapes at
55-71% of the H200's copy bandwidth (docs/benchmarks/2026-11-30-qwen3-h200). This kernel
gives each program a strip of output columns over all (or a split of) K, keeps the few rows
of `x` padded to one 16-row MMA tile, and accumulates in float32. A split over K writes float32
partials that one deterministic sum reduces, so a row's result never depends on the others or
on the run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # one MMA tile of rows


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_os,
    stride_om,
    K_PER_SPLIT,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, 16)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = split * K_PER_SPLIT
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        ks = k_start + k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :],
            mask=(rows[:, None] < M) & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[:, None] * stride_wn + ks[None, :],
            mask=(cols[:, None] < N) & k_ok[None, :],
            other=0.0,
        )
        acc = tl.dot(x, tl.trans(w), acc)
    out = out_ptr + split * stride_os + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def default_config(n: int, k: int) -> SkinnyConfig:
    """Enough programs to cover the SMs a few times over; K split only when N is narrow."""
    block_n = 32 if n >= 8192 else 16
    split_k = 1
    while (n // block_n) * split_k < 512 and k // (split_k * 2) >= 1024:
        split_k *= 2
    return SkinnyConfig(block_n=block_n, block_k=256, split_k=split_k, num_warps=4, num_stages=4)


def skinny_gemm(
    x: torch.Tensor, w: torch.Tensor, config: SkinnyConfig | None = None
) -> torch.Tensor:
    """`F.linear(x, w)` for x [M, K] with M ≤ 16 and w [N, K], both contiguous in K."""
    m, k = x.shape
    n = w.shape[0]
    assert m <= MAX_ROWS and w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1
    cfg = config or default_config(n, k)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)
    dtype = x.dtype if splits == 1 else torch.float32
    out = torch.empty((splits, m, n), dtype=dtype, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), splits)
    _skinny_gemm_kernel[grid](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), out.stride(1), k_per_split,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return out[0] if splits == 1 else out.sum(0).to(x.dtype)
