"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5) as torch reference ops: the CPU path
and the yardstick of the fast kernels (`core.kernels.indexer`, FlashInfer's MLA).

A small "lightning indexer" scores, for every query row, every key its sequence has cached so
far; the row then attends (MLA, absorbed form) only to its `top_k` best-scoring keys. Per
layer the indexer caches one key k[s] [dim] per token (its own arena, paged like the latent
one); row t brings queries q[t] [heads, dim] and head weights w[t] [heads]:

    score[t, s] = Σ_h w[t, h] · relu(scale · q[t, h] · k[s])      for s ≤ position(t)

(the line folds any extra factor on the weights, e.g. GLM-5's heads^-0.5, into w). A step's
rows are addressed as the kernels address them: row t belongs to sequence `seq_of_row[t]`,
whose pages are row `seq_of_row[t]` of `block_tables` [sequences, pages] (int32), and sees its
first `visible[t]` (= position + 1) keys. Scores come as a [rows, columns] float32 matrix,
-inf past each row's visible keys, and the selection as the cache slots of each row's top-k
keys, best first: a row that sees n keys has min(top_k, n) valid slots, the rest of its row
unspecified (`counts` says how many are valid).
"""

from __future__ import annotations

import torch


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
    """q [rows, heads, dim], weights [rows, heads] (float32), one layer's keys k_layer [blocks,
    block_size, dim] → scores [rows, columns] float32, in float32 as transformers computes
    them (q·k, scaled, ReLU, then the weighted sum over heads)."""
    block_size = k_layer.shape[1]
    cols = torch.arange(columns, device=q.device)
    # Columns past a table's pages are never visible: any page serves for them.
    pages = block_tables.long()[:, (cols // block_size).clamp(max=block_tables.shape[1] - 1)]
    keys = k_layer.flatten(0, 1)[pages * block_size + cols % block_size]
    scores = torch.empty(q.shape[0], columns, dtype=torch.float32, device=q.device)
    for seq in seq_of_row.unique().tolist():
        rows = (seq_of_row == seq).nonzero()[:, 0]
        per_head = torch.relu((q[rows].float() @ keys[seq].float().t()) * scale)
        scores[rows] = (weights[rows].float()[:, None, :] @ per_head)[:, 0]
    hidden = cols[None, :] >= visible[:, None]
    return scores.masked_fill(hidden, -torch.inf)


def top_k_slots(
    scores: torch.Tensor,
    top_k: int,
    block_tables: torch.Tensor,
    seq_of_row: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """The cache slots of each row's `min(top_k, columns)` best-scoring keys, best first:
    [rows, k] int32 (torch.topk: on the device where the scores are). Past a row's visible
    keys the picks are hidden columns (-inf), which may lie beyond its table: they map into
    its last page, and whoever reads the slots reads only the visible count."""
    k = min(top_k, scores.shape[1])
    positions = scores.topk(k, dim=-1).indices
    pages = block_tables.shape[1]
    page = torch.div(positions, block_size, rounding_mode="floor").clamp(max=pages - 1)
    flat = seq_of_row.long()[:, None] * pages + page
    blocks = block_tables.reshape(-1)[flat].long()
    return (blocks * block_size + positions % block_size).to(torch.int32)


def sparse_latent_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_layer: torch.Tensor,
    kpe_layer: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """MLA's absorbed form over selected keys: row t [heads, latent | rope] attends to the
    cached latents and rope keys at its first `counts[t]` slots of `slots` [rows, k]; out
    [rows, heads, latent]. Scores and softmax in float32 at least."""
    acc = torch.promote_types(q_latent.dtype, torch.float32)
    index = slots.long().clamp(min=0)
    c = ckv_layer.flatten(0, 1)[index].to(acc)  # [rows, k, latent]
    k_pe = kpe_layer.flatten(0, 1)[index].to(acc)
    scores = (torch.einsum("thl,tkl->thk", q_latent.to(acc), c)
              + torch.einsum("thr,tkr->thk", q_pe.to(acc), k_pe)) * scale  # fmt: skip
    valid = torch.arange(slots.shape[1], device=slots.device)[None, :] < counts[:, None]
    probs = scores.masked_fill(~valid[:, None, :], -torch.inf).softmax(dim=-1)
    return torch.einsum("thk,tkl->thl", probs, c).to(q_latent.dtype)
