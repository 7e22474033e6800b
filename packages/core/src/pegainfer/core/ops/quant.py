"""Quantized weights in plain torch: the exact dequantization every quantized layer's CPU path
runs and every kernel is measured against, the quantizers that write test checkpoints in the
real layouts, and the per-token-group activation quantization of the FP8 GEMM.

FP8 block scales are indexed with ceil-sized blocks: a weight of 576 rows has 5 scale rows,
the last covering rows 512..575 (transformers 5.23 divides the shape by the scale grid and
gets this wrong; see the Kimi/GLM reference note).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_NIBBLES = 8  # INT4 values per int32
_INT4_OFFSET = 8  # stored nibble = value + 8


def expand_blocks(
    scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]
) -> torch.Tensor:
    """scale [.., ceil(rows / b0), ceil(cols / b1)] repeated over each block: [.., rows, cols]."""
    full = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    return full.repeat_interleave(block[1], dim=-1)[..., :cols]


def dequantize_fp8_block(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """W = weight (e4m3) x its block's scale, in float32, rounded once to `dtype`. Works on a
    stack of weights [.., N, K] with scales [.., ceil(N / b0), ceil(K / b1)]."""
    rows, cols = weight.shape[-2:]
    return (weight.float() * expand_blocks(scale.float(), rows, cols, block)).to(dtype)


def quantize_fp8_block(
    weight: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block quantization of weight [N, K]: scale = amax(|block|) / 448 (float32,
    [ceil(N / b0), ceil(K / b1)]) and weight / scale in e4m3."""
    rows, cols = weight.shape
    b0, b1 = block
    pad_rows, pad_cols = -rows % b0, -cols % b1
    padded = torch.nn.functional.pad(weight.float(), (0, pad_cols, 0, pad_rows))
    blocks = padded.unflatten(0, (-1, b0)).unflatten(2, (-1, b1))  # [nb, b0, kb, b1]
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (weight.float() / expand_blocks(scale, rows, cols, block)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8), scale


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [.., N, K / 8] -> int8 values in [-8, 7], [.., N, K]: nibble j of word w is
    column 8w + j (low nibble first), stored as value + 8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles - _INT4_OFFSET).to(torch.int8).flatten(-2)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """The inverse of `unpack_int4`: int values in [-8, 7], [.., N, K] (K a multiple of 8)."""
    nibbles = (values.to(torch.int32) + _INT4_OFFSET).unflatten(-1, (-1, _NIBBLES))
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=values.device)
    # Bit 31 set makes a negative int32; summing the shifted nibbles is their bitwise or.
    return (nibbles << shifts).sum(dim=-1, dtype=torch.int64).to(torch.int32)


def dequantize_int4_group(
    packed: torch.Tensor, scale: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """W[n, k] = value(n, k) x scale[n, k // group_size], in float32, rounded once to `dtype`."""
    values = unpack_int4(packed).float()
    return (values * scale.float().repeat_interleave(group_size, dim=-1)).to(dtype)


def quantize_int4_group(
    weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' symmetric INT4 of weight [N, K]: scale = amax(|group|) / 7.5 (stored
    in `scale_dtype`), values round(w / scale) clamped to [-8, 7]; returns (packed, scale)."""
    groups = weight.float().unflatten(-1, (-1, group_size))
    scale = (groups.abs().amax(dim=-1) / 7.5).clamp(min=1e-12).to(scale_dtype)
    values = (groups / scale.float()[..., None]).round().clamp(-8, 7).flatten(-2)
    return pack_int4(values), scale


def quantize_activations_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] per token and group of `group` columns: scale = amax / 448 (float32 [M,
    ceil(K / group)]) and x / scale in e4m3, as DeepSeek-V3's dynamic activation quantization."""
    cols = x.shape[-1]
    padded = torch.nn.functional.pad(x.float(), (0, -cols % group))
    groups = padded.unflatten(-1, (-1, group))
    scale = groups.abs().amax(dim=-1).clamp(min=1e-10) / FP8_MAX
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).flatten(-2)[:, :cols]
    return q.to(FP8), scale
