"""Which drafts a verify step accepts, and the token that follows them.

A request with n drafts d_1..d_n has n + 1 logits rows: row j scores the token after d_j (row 0
the token after its last accepted one). Greedy acceptance keeps drafts while each equals its
row's argmax, then takes the argmax of the first row that differs (or of row n). Sampled
acceptance is rejection sampling (Leviathan et al., Chen et al.): draft d_j, drawn from the
drafter's q_j, is kept with probability min(1, p_j(d_j) / q_j(d_j)) where p_j is the target's
distribution at its row; the first rejected row draws from max(p_j - q_j, 0) renormalised, and
when all n are kept row n draws a bonus token from p_n. Every token then follows the target's
distribution exactly, whatever the drafter proposed. A drafter that drafts deterministically
(greedily) has q_j one-hot at d_j.

Tensors are padded to the step's widest request: [S, K] drafts, [S, K + 1] rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pegainfer.core.sampling.sampler import race


@dataclass(frozen=True)
class Verified:
    """Per request, on the device: `tokens` [S, K + 1], of which the first `num_accepted` + 1
    are its output (the accepted drafts, then the token after them)."""

    tokens: torch.Tensor
    num_accepted: torch.Tensor

    def runs(self) -> list[list[int]]:
        """Each request's output tokens, on the host (waits for the device)."""
        tokens, counts = self.tokens.tolist(), self.num_accepted.tolist()
        return [row[: n + 1] for row, n in zip(tokens, counts, strict=True)]


def _accepted_prefix(keep: torch.Tensor) -> torch.Tensor:
    """The length of each row's leading run of True [S, K] -> [S]."""
    return keep.long().cumprod(dim=1).sum(dim=1)


def draft_mask(num_drafts: torch.Tensor, width: int) -> torch.Tensor:
    """[S, width]: True where column j < the request's number of drafts."""
    return torch.arange(width, device=num_drafts.device)[None, :] < num_drafts[:, None]


def greedy_accept(target: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> Verified:
    """`target` [S, K + 1]: each row's argmax; `drafts` [S, K]. A kept draft equals its row's
    argmax, so the output is the argmax row for row."""
    width = drafts.shape[1]
    keep = (drafts == target[:, :width]) & draft_mask(num_drafts, width)
    return Verified(target, _accepted_prefix(keep))


def rejection_sample(
    probs: torch.Tensor,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_drafts: torch.Tensor,
    uniform: torch.Tensor,
    noise: torch.Tensor,
) -> Verified:
    """`probs` [S, K + 1, V]: the target's normalised distribution at each row; `drafts`
    [S, K]; `draft_probs` [S, K, V] the drafter's (None: one-hot at the drafts); `uniform`
    [S, K] U(0, 1) draws that decide acceptance; `noise` [S, K + 1, V] Exp(1) draws for the
    token after the accepted drafts (the exponential race)."""
    num_seqs, width = drafts.shape
    drafts = drafts.clamp_min(0)  # padding (-1) past a request's drafts is never kept
    index = drafts[..., None]
    p_draft = probs[:, :width].gather(-1, index).squeeze(-1)
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs.gather(-1, index)
    if draft_probs is not None:
        q_draft = q_draft.squeeze(-1)
    keep = (uniform * q_draft < p_draft) & draft_mask(num_drafts, width)
    accepted = _accepted_prefix(keep)
    seqs = torch.arange(num_seqs, device=probs.device)
    # The distribution of the token after the accepted drafts: the residual at the first
    # rejected row, or the bonus row's target distribution when every draft was kept.
    rejected_row = accepted.clamp_max(max(width - 1, 0))
    final = probs[seqs, num_drafts]
    if width:
        p_row = probs[seqs, rejected_row]
        if draft_probs is None:
            q_row = torch.zeros_like(p_row).scatter_(-1, drafts[seqs, rejected_row, None], 1.0)
        else:
            q_row = draft_probs[seqs, rejected_row]
        residual = (p_row - q_row).clamp_min(0.0)
        # p == q leaves nothing to draw from (a rejection of probability 0 that rounding let
        # through): draw from p itself.
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, p_row, residual)
        final = torch.where((accepted < num_drafts)[:, None], residual, final)
    token = race(final, noise[seqs, accepted])
    tokens = torch.cat([drafts, drafts.new_zeros(num_seqs, 1)], dim=1)
    tokens[seqs, accepted] = token
    return Verified(tokens, accepted)
