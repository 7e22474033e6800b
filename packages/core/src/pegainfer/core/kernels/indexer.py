"""The lightning indexer's scores over a paged key cache in one kernel (CUDA; reference and
layout: `ops.sparse_attention.indexer_scores`).

One program per (row, block of keys): it gathers the block's keys through the row's sequence's
block table, multiplies them with the row's [heads, dim] queries on the tensor cores (float32
accumulation), applies scale and ReLU, and sums the heads with the row's weights. Key blocks
past a row's visible keys only store -inf, so a decode graph can launch a fixed grid over
`max_model_len` columns and pay for each row's real length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_N = 64


@triton.jit
def _indexer_scores_kernel(
    q, weights, k_cache, block_tables, seq_of_row, visible, out,
    stride_q_row, stride_q_head, stride_w_row, stride_k_block, stride_k_slot,
    stride_table, stride_out, columns, block_size, scale,
    HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK_N
    cols = start + tl.arange(0, BLOCK_N)
    seen = tl.load(visible + row)
    dst = out + row * stride_out + cols
    if start < seen:
        keep = cols < seen
        seq = tl.load(seq_of_row + row).to(tl.int64)
        block = tl.load(block_tables + seq * stride_table + cols // block_size, mask=keep, other=0)
        key_rows = block.to(tl.int64) * stride_k_block + (cols % block_size) * stride_k_slot
        dims = tl.arange(0, DIM)
        k = tl.load(k_cache + key_rows[:, None] + dims[None, :], mask=keep[:, None], other=0.0)
        heads = tl.arange(0, HEADS)
        qh = tl.load(q + row * stride_q_row + heads[:, None] * stride_q_head + dims[None, :])
        if IEEE:
            logits = tl.dot(qh, tl.trans(k), input_precision="ieee")
        else:
            logits = tl.dot(qh, tl.trans(k))
        w = tl.load(weights + row * stride_w_row + heads).to(tl.float32)
        score = tl.sum(tl.maximum(logits * scale, 0.0) * w[:, None], axis=0)
        tl.store(dst, tl.where(keep, score, -float("inf")), mask=cols < columns)
    else:
        tl.store(dst, tl.full((BLOCK_N,), -float("inf"), tl.float32), mask=cols < columns)


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_of_row: torch.Tensor,
    visible: torch.Tensor,
    columns: int,
    scale: float,
) -> torch.Tensor:
    """`ops.sparse_attention.indexer_scores` on CUDA: q [rows, heads, dim] (heads ≥ 16 and dim
    powers of two), weights [rows, heads], k_layer [blocks, block_size, dim] of q's dtype,
    block_tables [sequences, pages] int32 → scores [rows, columns] float32."""
    rows, heads, dim = q.shape
    if heads < 16 or heads & (heads - 1) or dim & (dim - 1):
        raise ValueError(f"the indexer kernel takes 16+ heads and dims in powers of two, not "
                         f"{heads} × {dim}")  # fmt: skip
    if q.stride(2) != 1 or k_layer.stride(2) != 1 or weights.stride(1) != 1:
        raise ValueError("queries, keys and weights must be contiguous in their last dimension")
    if k_layer.dtype != q.dtype:
        raise ValueError(f"keys are {k_layer.dtype}, queries {q.dtype}")
    out = torch.empty(rows, columns, dtype=torch.float32, device=q.device)
    if rows == 0 or columns == 0:
        return out
    grid = (rows, triton.cdiv(columns, _BLOCK_N))
    _indexer_scores_kernel[grid](
        q, weights, k_layer, block_tables, seq_of_row, visible, out,
        q.stride(0), q.stride(1), weights.stride(0), k_layer.stride(0), k_layer.stride(1),
        block_tables.stride(0), out.stride(0), columns, k_layer.shape[1], scale,
        HEADS=heads, DIM=dim, BLOCK_N=_BLOCK_N, IEEE=q.dtype == torch.float32,
    )  # fmt: skip
    return out
