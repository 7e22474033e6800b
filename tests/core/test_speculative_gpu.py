"""Draft acceptance on CUDA: the same tokens and accepted counts as on the CPU for the same
inputs (CUDA; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.speculative.acceptance import greedy_accept, rejection_sample

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("seqs", "width", "vocab"), [(1, 1, 17), (7, 3, 1000), (64, 4, 151936)])
@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_acceptance_on_cuda_equals_cpu(seqs, width, vocab, with_draft_probs):
    g = torch.Generator().manual_seed(seqs * width)
    probs = torch.softmax(torch.randn(seqs, width + 1, vocab, generator=g) * 3, dim=-1)
    draft_probs = torch.softmax(torch.randn(seqs, width, vocab, generator=g) * 3, dim=-1)
    # Drafts from the target's likeliest tokens half the time, so some are kept.
    likely = probs[:, :width].argmax(dim=-1)
    other = torch.randint(0, vocab, (seqs, width), generator=g)
    drafts = torch.where(torch.rand(seqs, width, generator=g) < 0.5, likely, other)
    num_drafts = torch.randint(0, width + 1, (seqs,), generator=g)
    uniform = torch.rand(seqs, width, generator=g)
    noise = torch.empty(seqs, width + 1, vocab).exponential_(generator=g)
    inputs = (probs, drafts, draft_probs if with_draft_probs else None, num_drafts, uniform, noise)
    cpu = rejection_sample(*inputs)
    cuda = rejection_sample(*(None if t is None else t.cuda() for t in inputs))
    assert cuda.runs() == cpu.runs()
    target = probs.argmax(dim=-1)
    assert greedy_accept(target.cuda(), drafts.cuda(), num_drafts.cuda()).runs() == (
        greedy_accept(target, drafts, num_drafts).runs()
    )
