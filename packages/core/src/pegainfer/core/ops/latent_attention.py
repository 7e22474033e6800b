"""MLA's two attention forms, one sequence at a time (the references, not the fast paths).

Absorbed, over the paged latent cache:
Each cached token holds a latent c [latent_dim] and a roped key k_pe [rope_dim], shared by every
head: one layer's caches are `[num_blocks, block_size, latent_dim]` and `[num_blocks,
block_size, rope_dim]`, FlashInfer's MLA paged layout. Queries come absorbed: q_latent = W_ukᵀ
q_nope per head, so scores are q_latent·c + q_pe·k_pe and the output stays in latent space
(Σ p c), for the line to project with W_uv.

Expanded (`ragged_attention`): ordinary causal attention over keys and values already
up-projected from the latents, packed sequence after sequence.
"""

import torch

from pegainfer.core.runner.forward_batch import ForwardBatch


def paged_latent_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_layer: torch.Tensor,
    kpe_layer: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """Causal attention of q [tokens, heads, latent | rope] over each sequence's cached
    latents; out [tokens, heads, latent_dim]. Scores and softmax in float32 at least."""
    out = torch.empty_like(q_latent)
    acc = torch.promote_types(q_latent.dtype, torch.float32)
    bs, start = batch.block_size, 0
    for q_len, seq_len, table in zip(
        batch.query_lens_cpu, batch.seq_lens_cpu, batch.block_tables_cpu, strict=True
    ):
        blocks = torch.tensor(table[: (seq_len + bs - 1) // bs], device=q_latent.device)
        c = ckv_layer[blocks].flatten(0, 1)[:seq_len].to(acc)
        k_pe = kpe_layer[blocks].flatten(0, 1)[:seq_len].to(acc)
        rows = slice(start, start + q_len)
        scores = (q_latent[rows].to(acc) @ c.t() + q_pe[rows].to(acc) @ k_pe.t()) * scale
        # Query row j sits at position seq_len - q_len + j and sees keys up to that position.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q_latent.device)
        visible = torch.arange(seq_len, device=q_latent.device)[None, :] <= q_pos[:, None]
        probs = scores.masked_fill(~visible[:, None, :], -torch.inf).softmax(dim=-1)
        out[rows] = (probs @ c).to(out.dtype)
        start += q_len
    return out


def ragged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """MLA's expanded form: per sequence, its q rows [q_len, heads, qk] (the last q_len
    positions) over its keys [kv_len, heads, qk] and values [kv_len, heads, value], causal;
    sequences packed one after another. Out [rows, heads, value], scores in float32 at least."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    acc = torch.promote_types(q.dtype, torch.float32)
    q_start = kv_start = 0
    for q_len, kv_len in zip(q_lens, kv_lens, strict=True):
        rows, keys = slice(q_start, q_start + q_len), slice(kv_start, kv_start + kv_len)
        scores = torch.einsum("qhd,khd->hqk", q[rows].to(acc), k[keys].to(acc)) * scale
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        visible = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
        probs = scores.masked_fill(~visible, -torch.inf).softmax(dim=-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, v[keys].to(acc)).to(out.dtype)
        q_start, kv_start = q_start + q_len, kv_start + kv_len
    return out
