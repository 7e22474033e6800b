"""Token buckets of the piecewise graphs (the pieces themselves need CUDA: see the lines' GPU
tests, `assert_pieces_match_eager`)."""

from __future__ import annotations

import bisect

import pytest

from pegainfer.core.runner.piecewise_graphs import token_buckets


@pytest.mark.parametrize("budget", [16, 100, 256, 512, 1000, 2048, 8192])
def test_every_step_within_the_budget_has_a_bucket_padding_it_by_at_most_2x_or_255_rows(budget):
    buckets = token_buckets(budget)
    assert buckets == tuple(sorted(set(buckets))) and buckets[-1] == budget
    for tokens in range(1, budget + 1):
        bucket = buckets[bisect.bisect_left(buckets, tokens)]
        assert tokens <= bucket <= max(2 * tokens, 16, tokens + 255)
