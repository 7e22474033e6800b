"""Copying whole blocks between layer-major block tensors (KV arenas, staging buffers)."""

import torch


def copy_blocks(
    src: torch.Tensor, src_blocks: torch.Tensor, dst: torch.Tensor, dst_blocks: torch.Tensor
) -> None:
    """`dst[:, dst_blocks[i]] = src[:, src_blocks[i]]` for every i: both are `[layers,
    blocks, ...]` views with the same per-block shape."""
    dst[:, dst_blocks] = src[:, src_blocks]
