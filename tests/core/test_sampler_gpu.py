"""The sampler on CUDA: the same semantics as on the CPU (CUDA; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.sampling.sampler import SamplingBatch, filtered_probs, sample

pytestmark = pytest.mark.gpu
V = 1000


def batch(rows: int, seeds=None, **params) -> SamplingBatch:
    seeds = seeds or [None] * rows
    shared = torch.Generator("cuda").manual_seed(99)

    def col(name, default, dtype):
        return torch.full((rows,), params.get(name, default), dtype=dtype)

    return SamplingBatch(
        temperature=col("temperature", 1.0, torch.float32),
        top_k=col("top_k", V, torch.int64),
        top_p=col("top_p", 1.0, torch.float32),
        min_p=col("min_p", 0.0, torch.float32),
        generators=[shared if s is None else torch.Generator("cuda").manual_seed(s) for s in seeds],
        banned=[frozenset()] * rows,
    ).to(torch.device("cuda"))


@pytest.mark.parametrize(
    "params", [{}, {"temperature": 0.7, "top_k": 50}, {"top_p": 0.8}, {"min_p": 0.05}]
)
def test_gpu_frequencies_match_the_reference_distribution(params):
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0)) * 3
    n = 50_000
    tokens = sample(logits.cuda().expand(n, V).contiguous(), batch(n, **params))
    freq = torch.bincount(tokens.cpu(), minlength=V).float() / n
    expected = filtered_probs(logits, batch(1, **params).to(torch.device("cpu")))[0]
    expected = expected / expected.sum()
    assert (freq[expected == 0] == 0).all()
    assert (freq - expected).abs().max() < 0.01


def test_gpu_seeds_reproduce_and_ignore_the_batch():
    logits = torch.randn(4, V, device="cuda")
    alone = sample(logits[1:2], batch(1, seeds=[7]))
    together = sample(logits, batch(4, seeds=[None, 7, 8, None]))
    assert together[1] == alone[0]
