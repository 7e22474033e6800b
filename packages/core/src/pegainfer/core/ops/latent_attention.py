"""Attention over a paged latent (MLA) cache, one sequence at a time (the reference, not the
fast path).

Each cached token holds a latent c [latent_dim] and a roped key k_pe [rope_dim], shared by every
head: one layer's caches are `[num_blocks, block_size, latent_dim]` and `[num_blocks,
block_size, rope_dim]`, FlashInfer's MLA paged layout. Queries come absorbed: q_latent = W_ukᵀ
q_nope per head, so scores are q_latent·c + q_pe·k_pe and the output stays in latent space
(Σ p c), for the line to project with W_uv.
"""

import torch

from pegainfer.core.forward_batch import ForwardBatch


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
