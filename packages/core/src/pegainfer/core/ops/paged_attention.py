"""Attention over a paged GQA cache, one sequence at a time (the reference, not the fast path).

The cache of one layer is `[num_blocks, 2, block_size, num_kv_heads, head_dim]` (K then V per
block), FlashInfer's NHD paged layout, so the fast path reads the same memory.
"""

import torch
import torch.nn.functional as F

from pegainfer.core.runner.forward_batch import ForwardBatch


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> None:
    """Store this step's K and V [tokens, kv_heads, head_dim] at `batch.slot_mapping`."""
    blocks = batch.slot_mapping // batch.block_size
    offsets = batch.slot_mapping % batch.block_size
    kv_layer[blocks, 0, offsets] = k.to(kv_layer.dtype)
    kv_layer[blocks, 1, offsets] = v.to(kv_layer.dtype)


def paged_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """Causal attention of q [tokens, heads, head_dim] over each sequence's cached K/V."""
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], kv_layer.shape[3]
    bs = batch.block_size
    start = 0
    for i, (q_len, seq_len) in enumerate(
        zip(batch.query_lens_cpu, batch.seq_lens_cpu, strict=True)
    ):
        table = batch.block_tables_cpu[i][: (seq_len + bs - 1) // bs]
        blocks = torch.tensor(table, dtype=torch.long, device=q.device)
        k = kv_layer[blocks, 0].flatten(0, 1)[:seq_len]
        v = kv_layer[blocks, 1].flatten(0, 1)[:seq_len]
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        # Query row j sits at position seq_len - q_len + j and sees keys up to that position.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        qi = q[start : start + q_len].transpose(0, 1)
        attn = F.scaled_dot_product_attention(
            qi, k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype), mask, scale=scale
        )
        out[start : start + q_len] = attn.transpose(0, 1)
        start += q_len
    return out
