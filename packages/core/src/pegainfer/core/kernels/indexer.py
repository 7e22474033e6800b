"""The lightning indexer's scores over a paged key cache in one kernel (CUDA; reference and
layout: `ops.sparse_attention.indexer_scores`).

One program per (tile of rows, block of keys). A tile is up to BLOCK_M consecutive rows of one
sequence (a prefill chunk's rows share their keys): the program gathers the block's keys once
through the sequence's block table, multiplies them with the tile's [rows × heads, dim] queries
on the tensor cores (float32 accumulation), applies scale and ReLU, and sums each row's heads
with its weights. Tiles start at each sequence's first row and every BLOCK_M rows after it; a
program launched for a row that starts no tile returns at once, so the grid needs no host-side
tiling and a CUDA graph can replay it. Key blocks past a tile's visible keys only store -inf:
a decode graph launches a fixed grid over `max_model_len` columns and pays for each row's
real length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_N = 64
# Query rows (tile rows × heads) one program multiplies at once.
_TILE_QUERIES = 128


@triton.jit
def _indexer_scores_kernel(
    q, weights, k_cache, block_tables, seq_of_row, seq_starts, visible, out,
    rows, row_offset, stride_q_row, stride_q_head, stride_w_row, stride_k_block,
    stride_k_slot, stride_table, stride_out, columns, block_size, scale,
    HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    seq = tl.load(seq_of_row + row)
    # The sequence's first row in this call (rows are numbered from row_offset).
    first = tl.maximum(tl.load(seq_starts + seq) - row_offset, 0)
    if (row - first) % BLOCK_M == 0:
        start = tl.program_id(1) * BLOCK_N
        cols = start + tl.arange(0, BLOCK_N)
        tile = row + tl.arange(0, BLOCK_M)
        in_tile = tile < rows
        in_tile &= tl.load(seq_of_row + tile, mask=in_tile, other=-1) == seq
        seen = tl.load(visible + tile, mask=in_tile, other=0)
        dst = out + tile.to(tl.int64)[:, None] * stride_out + cols[None, :]
        store = in_tile[:, None] & (cols[None, :] < columns)
        if start < tl.max(seen, axis=0):
            keep = cols < tl.max(seen, axis=0)
            table = block_tables + seq.to(tl.int64) * stride_table
            block = tl.load(table + cols // block_size, mask=keep, other=0)
            key_rows = block.to(tl.int64) * stride_k_block + (cols % block_size) * stride_k_slot
            dims = tl.arange(0, DIM)
            k = tl.load(k_cache + key_rows[:, None] + dims[None, :], mask=keep[:, None],
                        other=0.0)  # fmt: skip
            # Query r of the tile: row r // HEADS, head r % HEADS.
            r = tl.arange(0, BLOCK_M * HEADS)
            q_row = row + r // HEADS
            q_ok = q_row < rows
            q_ok &= tl.load(seq_of_row + q_row, mask=q_ok, other=-1) == seq
            q_row = q_row.to(tl.int64)
            qs = tl.load(q + q_row[:, None] * stride_q_row + (r % HEADS)[:, None] * stride_q_head
                         + dims[None, :], mask=q_ok[:, None], other=0.0)  # fmt: skip
            if IEEE:
                logits = tl.dot(qs, tl.trans(k), input_precision="ieee")
            else:
                logits = tl.dot(qs, tl.trans(k))
            w = tl.load(weights + q_row * stride_w_row + r % HEADS, mask=q_ok, other=0.0)
            terms = tl.maximum(logits * scale, 0.0) * w.to(tl.float32)[:, None]
            score = tl.sum(tl.reshape(terms, (BLOCK_M, HEADS, BLOCK_N)), axis=1)
            score = tl.where(cols[None, :] < seen[:, None], score, -float("inf"))
            tl.store(dst, score, mask=store)
        else:
            tl.store(dst, tl.full((BLOCK_M, BLOCK_N), -float("inf"), tl.float32), mask=store)


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_of_row: torch.Tensor,
    visible: torch.Tensor,
    columns: int,
    scale: float,
    seq_starts: torch.Tensor,
    row_offset: int = 0,
) -> torch.Tensor:
    """`ops.sparse_attention.indexer_scores` on CUDA: q [rows, heads, dim] (heads ≥ 16, both
    powers of two), weights [rows, heads], k_layer [blocks, block_size, dim] of q's dtype,
    block_tables [sequences, pages] int32 → scores [rows, columns] float32. `seq_starts`: each
    sequence's first row, numbered from `row_offset` less than these rows are (a call may
    score a slice of a step's rows)."""
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
        q, weights, k_layer, block_tables, seq_of_row, seq_starts, visible, out,
        rows, row_offset, q.stride(0), q.stride(1), weights.stride(0), k_layer.stride(0),
        k_layer.stride(1), block_tables.stride(0), out.stride(0), columns, k_layer.shape[1],
        scale, HEADS=heads, DIM=dim, BLOCK_M=max(1, _TILE_QUERIES // heads), BLOCK_N=_BLOCK_N,
        IEEE=q.dtype == torch.float32,
    )  # fmt: skip
    return out
