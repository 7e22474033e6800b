"""GEMMs on quantized weights in Triton (reference: `ops.quant`, dequantize then matmul).

y [M, N] = x [M, K] W^T, W stored [N, K] as FP8 e4m3 with block scales or as INT4 groups:

- Weight-only (FP8 or INT4, `weight_only_linear`): each [BLOCK_K, BLOCK_N] tile of W^T is
  dequantized in registers exactly as the reference does (float32 product, one rounding to the
  activations' dtype) and fed to a bf16 tensor-core dot, accumulated in float32. Few rows
  (decode) make the GEMM a read of the weights, which FP8 halves and INT4 quarters against
  bf16; nothing is gained by quantizing activations there. The grid also splits K when the
  output's tiles alone cannot keep every SM reading (a 576-row kv_a at batch 1 is 9 tiles),
  the partial sums added afterwards in a fixed order (deterministic, CUDA-graph safe).
- FP8 x FP8 (`fp8_w8a8_linear`): many rows (prefill) make it bound by arithmetic, which FP8
  tensor cores do at twice bf16's rate. The activations are quantized per token and per
  group of `block_k` columns on the fly (DeepSeek-V3's dynamic scheme: scale = amax / 448),
  so every K step is one FP8 dot scaled by the row's and the weight block's scales.

`quant_linear` picks: FP8 weights with `W8A8_MIN_ROWS` rows or more take the FP8 x FP8
path, everything else the weight-only one. The tile helpers (`fp8_weight_tile`,
`int4_weight_tile`) are shared with the fused MoE.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from pegainfer.core.ops.quant import FP8, FP8_MAX
from pegainfer.core.quant.scheme import Fp8Block, Int4Group

if TYPE_CHECKING:
    from pegainfer.core.quant.linear import QuantLinear

# From this many rows on, an FP8 GEMM is bound by arithmetic rather than by reading the
# weights (H200: ~1.98 PFLOP/s of FP8 against 4.8 TB/s puts the ridge near 200 flops per weight
# byte, 2 M flops per byte here), and FP8 tensor cores win over dequantizing to bf16.
W8A8_MIN_ROWS = 64


@cache
def _sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; of the current CUDA device for a meta tensor's
    (a kernel plan recording what this process's GPU will launch: `kernels/precompile.py`)."""
    return torch.cuda.get_device_properties(
        torch.cuda.current_device() if device.type == "meta" else device
    ).multi_processor_count


@triton.jit
def fp8_weight_tile(
    w, scale, k0, ks, cols, k_ok, col_ok, stride_wn, stride_sn, K,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """W^T's tile [ks, cols] dequantized to DTYPE: e4m3 x its block's scale in float32. The
    tile lies in one block column (k0 // BLOCK_COLS); `w` points at W [N, K] (row stride
    `stride_wn`), `scale` at its [ceil(N / BLOCK_ROWS), ceil(K / BLOCK_COLS)] scales."""
    b = tl.load(w + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
    # A tile past K (a K split's last) multiplies zeros: any block's scale does.
    block = tl.minimum(k0, K - 1) // BLOCK_COLS
    s = tl.load(scale + (cols // BLOCK_ROWS) * stride_sn + block, mask=col_ok, other=0.0)
    return (b.to(tl.float32) * s[None, :]).to(DTYPE)


@triton.jit
def int4_weight_tile(
    w, scale, k0, cols, col_ok, stride_wn, stride_sn, K,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """W^T's tile [k0 .. k0 + BLOCK_K, cols] dequantized to DTYPE: `w` points at the packed
    words [N, K / 8] (nibble j of word i is column 8i + j, stored as value + 8), `scale` at the
    [N, K / GROUP] group scales; value x scale in float32, rounded once."""
    words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    packed = tl.load(w + cols[None, :].to(tl.int64) * stride_wn + words[:, None],
                     mask=(words[:, None] < K // 8) & col_ok[None, :], other=0)  # fmt: skip
    shifts = tl.arange(0, 8) * 4
    nibbles = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [BLOCK_K / 8, 8, BLOCK_N]
    values = tl.reshape(nibbles, (BLOCK_K, BLOCK_N)).to(tl.float32) - 8.0
    groups = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    s = tl.load(scale + cols[None, :].to(tl.int64) * stride_sn + groups[:, None],
                mask=(groups[:, None] < K // GROUP) & col_ok[None, :], other=0.0)  # fmt: skip
    scaled = tl.reshape(values, (BLOCK_K // GROUP, GROUP, BLOCK_N)) * s.to(tl.float32)[:, None, :]
    return tl.reshape(scaled, (BLOCK_K, BLOCK_N)).to(DTYPE)


@triton.jit
def _weight_only_kernel(
    x, w, scale, out, M, N, K, stride_xm, stride_wn, stride_sn, stride_os, stride_om,
    TILES_PER_SPLIT, INT4: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    row_ok, col_ok = rows < M, cols < N
    dtype = x.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(TILES_PER_SPLIT):
        k0 = (split * TILES_PER_SPLIT + t) * BLOCK_K
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        if INT4:
            b = int4_weight_tile(w, scale, k0, cols, col_ok, stride_wn, stride_sn, K,
                                 SCALE_COLS, BLOCK_K, BLOCK_N, dtype)  # fmt: skip
        else:
            b = fp8_weight_tile(w, scale, k0, ks, cols, k_ok, col_ok, stride_wn, stride_sn, K,
                                SCALE_ROWS, SCALE_COLS, dtype)  # fmt: skip
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    dest = out + split * stride_os + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(dest, acc.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def tile_k(block_cols: int, cap: int = 128) -> int:
    """The longest power-of-two K tile (16 .. cap) inside one scale block of `block_cols`."""
    tile = cap
    while tile >= 16:
        if block_cols % tile == 0:
            return tile
        tile //= 2
    raise ValueError(
        f"the CUDA kernels need quantization blocks or groups of a multiple of 16 columns, "
        f"not {block_cols}"
    )


def weight_only_linear(x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
    """x [M, K] W^T with W dequantized tile by tile (FP8 blocks or INT4 groups)."""
    weight, scale = layer.stored()
    fmt = layer.fmt
    m, k = x.shape
    n = layer.out_features
    if isinstance(fmt, Int4Group):
        if fmt.group_size & (fmt.group_size - 1):
            size = fmt.group_size
            raise ValueError(f"the INT4 kernel needs a power-of-two group size, not {size}")
        int4, scale_rows, scale_cols = True, 1, fmt.group_size
        block_k = max(fmt.group_size, 128)
    else:
        int4, (scale_rows, scale_cols) = False, fmt.block
        block_k = tile_k(scale_cols)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    # Enough programs to keep every SM streaming weights (two per SM), each with >= 4 K tiles.
    split = max(1, min(triton.cdiv(2 * _sms(x.device), tiles), k_tiles // 4))
    per_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, per_split)
    if split == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
    _weight_only_kernel[grid](
        x, weight, scale, out, m, n, k, x.stride(0), weight.stride(0), scale.stride(0),
        out.stride(0) if split > 1 else 0, out.stride(-2), per_split,
        INT4=int4, SCALE_ROWS=scale_rows, SCALE_COLS=scale_cols, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32, num_warps=4,
        num_stages=4,
    )  # fmt: skip
    return out if split == 1 else out.sum(dim=0).to(x.dtype)


@triton.jit
def _quantize_activations_kernel(
    x, q, scale, K, stride_x, groups,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    cols = group * GROUP + offs
    ok = (offs < GROUP) & (cols < K)
    v = tl.load(x + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(v), axis=0), 1e-10) / FP8_MAX
    tl.store(q + row * K + cols, tl.clamp(v / s, -FP8_MAX, FP8_MAX).to(q.dtype.element_ty),
             mask=ok)  # fmt: skip
    tl.store(scale + row * groups + group, s)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.quant.quantize_activations_fp8` on the GPU: e4m3 [M, K] and float32 [M, K / group]."""
    m, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scale = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        _quantize_activations_kernel[(m, groups)](
            x, q, scale, k, x.stride(0), groups, GROUP=group,
            BLOCK=triton.next_power_of_2(group), FP8_MAX=FP8_MAX,
        )  # fmt: skip
    return q, scale


@triton.jit
def _w8a8_kernel(
    a, a_scale, w, w_scale, out, M, N, K, stride_am, stride_wn, stride_asm, stride_wsn,
    stride_om, SCALE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # Consecutive programs share column tiles of W (grouped order: W stays in L2).
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    a_rows = a + rows[:, None].to(tl.int64) * stride_am
    w_cols = w + cols[None, :].to(tl.int64) * stride_wn
    w_scales = w_scale + (cols // SCALE_ROWS) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        y = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        sa = tl.load(a_scale + rows * stride_asm + k0 // BLOCK_K, mask=row_ok, other=0.0)
        sw = tl.load(w_scales + k0 // BLOCK_K, mask=col_ok, other=0.0)
        acc += tl.dot(x, y) * sa[:, None] * sw[None, :]
    tl.store(out + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
             acc.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


def fp8_w8a8_linear(x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
    """x [M, K] W^T for FP8 block weights, with x quantized per token and block_k columns."""
    assert isinstance(layer.fmt, Fp8Block)
    weight, scale = layer.stored()
    block_n, block_k = layer.fmt.block
    if block_k not in (32, 64, 128):
        raise ValueError(f"the FP8 x FP8 kernel needs 32, 64 or 128-column blocks, not {block_k}")
    m, k = x.shape
    n = layer.out_features
    q, q_scale = quantize_activations(x, block_k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, warps = (64, 4) if m <= 256 else (128, 8)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, 128),)
    _w8a8_kernel[grid](
        q, q_scale, weight, scale, out, m, n, k, q.stride(0), weight.stride(0),
        q_scale.stride(0), scale.stride(0), out.stride(0), SCALE_ROWS=block_n, BLOCK_M=block_m,
        BLOCK_N=128, BLOCK_K=block_k, GROUP_M=8, num_warps=warps, num_stages=3,
    )  # fmt: skip
    return out


def quant_linear(x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
    """x [.., K] W^T on CUDA: FP8 x FP8 for many rows of FP8 block weights, else weight-only."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    w8a8 = isinstance(layer.fmt, Fp8Block) and layer.fmt.block[1] in (32, 64, 128)
    if rows.shape[0] == 0:
        out = rows.new_empty(0, layer.out_features)
    elif rows.shape[0] >= W8A8_MIN_ROWS and w8a8:
        out = fp8_w8a8_linear(rows, layer)
    else:
        out = weight_only_linear(rows, layer)
    return out.view(*x.shape[:-1], layer.out_features)
