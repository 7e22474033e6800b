"""Draft acceptance: greedy keeps the drafts that equal the argmax; rejection sampling's
output follows the target's distribution whatever the drafter proposed (chi-square tests on an
8-token vocabulary, fixed seeds)."""

from __future__ import annotations

import torch

from pegainfer.core.speculative.acceptance import greedy_accept, rejection_sample

V = 8
# The chi-square statistic's 0.999 quantile with V - 1 = 7 degrees of freedom.
CHI2_7_999 = 24.32


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=V).double()
    expected = probs.double() * tokens.numel()
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a token of probability 0 was drawn"
    return float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())


def test_greedy_accept_keeps_the_matching_prefix():
    target = torch.tensor([[3, 5, 7, 1], [3, 5, 7, 1], [2, 2, 2, 2], [4, 0, 0, 0]])
    drafts = torch.tensor([[3, 5, 7], [3, 6, 7], [1, 2, 2], [-1, -1, -1]])
    verified = greedy_accept(target, drafts, torch.tensor([3, 3, 3, 0]))
    assert verified.num_accepted.tolist() == [3, 1, 0, 0]
    assert verified.runs() == [[3, 5, 7, 1], [3, 5], [2], [4]]
    # Padding past a request's own drafts is never kept, even where it would match.
    padded = greedy_accept(target[:1], torch.tensor([[3, 5, 7]]), torch.tensor([2]))
    assert padded.runs() == [[3, 5, 7]]


def test_rejection_sampling_of_one_hot_targets_is_greedy_acceptance():
    """Greedy rows have one-hot target distributions: rejection sampling then keeps exactly the
    drafts greedy acceptance keeps and adds the argmax after them."""
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, V, (64, 4), generator=g)
    drafts = torch.where(
        torch.rand(64, 3, generator=g) < 0.7, target[:, :3], (target[:, :3] + 1) % V
    )
    num_drafts = torch.randint(0, 4, (64,), generator=g)
    probs = torch.nn.functional.one_hot(target, V).float()
    uniform = torch.rand(64, 3, generator=g)
    noise = torch.empty(64, 4, V).exponential_(generator=g)
    sampled = rejection_sample(probs, drafts, None, num_drafts, uniform, noise)
    greedy = greedy_accept(target, drafts, num_drafts)
    assert sampled.runs() == greedy.runs()


def draws(n: int, width: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(n, width, generator=g), torch.empty(n, width + 1, V).exponential_(generator=g)


def test_rejection_sampling_follows_the_target_distribution():
    """Drafts drawn from a drafter's q: the first output token follows p_0, and where the first
    draft was kept, the second follows p_1; a request with no drafts draws from p_0 alone."""
    g = torch.Generator().manual_seed(1)
    n, width = 40_000, 2
    p = torch.softmax(torch.randn(width + 1, V, generator=g) * 1.5, dim=-1)
    p[0, 3] = 0.0  # a token the target never emits (the drafter proposes it often)
    p[0] /= p[0].sum()
    q = torch.softmax(torch.randn(width, V, generator=g) * 1.5, dim=-1)
    q[0, 3] += 0.3
    q[0] /= q[0].sum()
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g)
                          for j in range(width)], dim=1)  # fmt: skip
    num_drafts = torch.full((n,), width)
    num_drafts[: n // 4] = 0
    uniform, noise = draws(n, width, g)
    verified = rejection_sample(p.expand(n, -1, -1), drafts, q.expand(n, -1, -1), num_drafts,
                                uniform, noise)  # fmt: skip
    assert chi_square(verified.tokens[:, 0], p[0]) < CHI2_7_999
    drafted = num_drafts > 0
    second = drafted & (verified.num_accepted >= 1)
    assert second.sum() > n // 10
    assert chi_square(verified.tokens[second, 1], p[1]) < CHI2_7_999
    assert chi_square(verified.tokens[~drafted, 0], p[0]) < CHI2_7_999
    # Some drafts were kept and some rejected, at each position.
    accepted = verified.num_accepted[drafted]
    assert {0, 1, 2} <= set(accepted.tolist())


def test_rejection_sampling_of_deterministic_drafts():
    """A drafter that drafts one token for sure (q one-hot, `draft_probs` None): the output
    still follows p_0."""
    g = torch.Generator().manual_seed(2)
    n = 40_000
    p = torch.softmax(torch.randn(2, V, generator=g), dim=-1)
    drafts = torch.full((n, 1), int(p[0].argmin()))
    uniform, noise = draws(n, 1, g)
    verified = rejection_sample(p.expand(n, -1, -1), drafts, None, torch.ones(n, dtype=torch.long),
                                uniform, noise)  # fmt: skip
    assert chi_square(verified.tokens[:, 0], p[0]) < CHI2_7_999
