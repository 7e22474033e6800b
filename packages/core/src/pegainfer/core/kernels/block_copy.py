"""Block copies between layer-major tensors (reference: `ops.block_copy.copy_blocks`).

One launch moves a whole group of blocks in every layer. torch's indexed copy into a KV arena
is slow here: an arena has more than 2^31 elements, so TensorIterator splits the copy into a
launch per layer, each a few microseconds of GPU time for a few hundred kilobytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_blocks_kernel(
    src, dst, src_blocks, dst_blocks,
    src_layer_stride, src_block_stride, dst_layer_stride, dst_block_stride,
    block_numel, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    s = tl.load(src_blocks + i).to(tl.int64)
    d = tl.load(dst_blocks + i).to(tl.int64)
    x = tl.load(src + layer * src_layer_stride + s * src_block_stride + offs, mask=mask)
    tl.store(dst + layer * dst_layer_stride + d * dst_block_stride + offs, x, mask=mask)


def copy_blocks(
    src: torch.Tensor, src_blocks: torch.Tensor, dst: torch.Tensor, dst_blocks: torch.Tensor
) -> None:
    """`dst[:, dst_blocks[i]] = src[:, src_blocks[i]]` for every i: both are `[layers,
    blocks, ...]` views (any layer and block strides) whose per-block part is contiguous."""
    block_shape = src.shape[2:]
    if dst.shape[2:] != block_shape or dst.shape[0] != src.shape[0] or dst.dtype != src.dtype:
        raise ValueError(f"blocks differ: {tuple(src.shape)} {src.dtype} -> "
                         f"{tuple(dst.shape)} {dst.dtype}")  # fmt: skip
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} targets")
    if not len(src_blocks):
        return
    for t in (src, dst):
        if not t[0, 0].is_contiguous():
            raise ValueError("a block's part of each layer must be contiguous")
    numel = block_shape.numel()
    block = min(4096, triton.next_power_of_2(numel))
    grid = (len(src_blocks), src.shape[0], triton.cdiv(numel, block))
    _copy_blocks_kernel[grid](
        src, dst, src_blocks, dst_blocks, src.stride(0), src.stride(1), dst.stride(0),
        dst.stride(1), numel, BLOCK=block,
    )  # fmt: skip
