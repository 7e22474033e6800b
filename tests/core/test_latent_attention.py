"""The reference latent (MLA) attention: absorbed queries over a paged latent cache give the
expanded per-head attention (float64, so only the algebra differs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pegainfer.core.forward_batch import ForwardBatch
from pegainfer.core.latent_attention import LatentShape, make_latent_attention

HEADS, NOPE, ROPE, RANK, V, BLOCK = 4, 16, 8, 32, 16, 4


def expanded(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale):
    """One sequence's last q rows, causal, with K = [W_uk c | k_pe] and V = W_uv c per head."""
    q_len, seq_len = q_nope.shape[0], c.shape[0]
    k = torch.cat((torch.einsum("sr,hnr->shn", c, w_uk), k_pe[:, None].expand(-1, HEADS, -1)), -1)
    v = torch.einsum("sr,hvr->shv", c, w_uv)
    q = torch.cat((q_nope, q_pe), dim=-1)
    q_pos = torch.arange(seq_len - q_len, seq_len)
    mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale=scale
    )
    return out.transpose(0, 1)


def test_absorbed_paged_attention_equals_the_expanded_form():
    """A step with a prefill chunk over a cached prefix (7 new rows at 9..15), a decode (row
    at 22) and a first chunk (5 rows from 0), blocks scattered over the cache."""
    g = torch.Generator().manual_seed(0)
    f64 = torch.float64

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=f64) * scale

    num_blocks, scale = 20, 0.2
    ckv, kpe = randn(num_blocks, BLOCK, RANK), randn(num_blocks, BLOCK, ROPE)
    w = randn(HEADS, NOPE + V, RANK, scale=0.3)
    w_uk, w_uv = w[:, :NOPE], w[:, NOPE:]
    starts, lengths = [9, 22, 0], [7, 1, 5]
    tables = [[3, 11, 0, 7], [5, 2, 19, 8, 14, 1], [12, 6]]
    batch = ForwardBatch.build(
        [[0] * n for n in lengths], starts, tables, [True] * 3, BLOCK, torch.device("cpu")
    )
    tokens = sum(lengths)
    q_nope, q_pe = randn(tokens, HEADS, NOPE), randn(tokens, HEADS, ROPE)
    attn = make_latent_attention(LatentShape(HEADS, RANK, ROPE, scale), f64,
                                 torch.device("cpu"), max_pages_per_seq=8)  # fmt: skip
    attn.plan(batch)
    q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
    ours = torch.einsum("thr,hvr->thv", attn.run(q_latent, q_pe, ckv, kpe), w_uv)
    row = 0
    for start, n, table in zip(starts, lengths, tables, strict=True):
        seq_len = start + n
        c = ckv[table].flatten(0, 1)[:seq_len]
        k_pe = kpe[table].flatten(0, 1)[:seq_len]
        rows = slice(row, row + n)
        ref = expanded(q_nope[rows], q_pe[rows], c, k_pe, w_uk, w_uv, scale)
        assert torch.allclose(ours[rows], ref, atol=1e-12)
        row += n
