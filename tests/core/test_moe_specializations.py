"""`specializing_token_counts`: one step size per specialization the fused MoE can launch."""

from __future__ import annotations

from pegainfer.core.moe import kernels
from pegainfer.core.moe.kernels import specializing_token_counts


def launch(tokens: int, top_k: int, num_experts: int) -> tuple:
    """What `fused_moe` specializes on for a step of `tokens` tokens."""
    pairs = tokens * top_k
    block_m, _ = kernels._tiles(pairs, num_experts)
    blocks = kernels._dispatch_blocks(pairs, num_experts, block_m)
    one_program = pairs <= kernels._ONE_PROGRAM_PAIRS
    sizes = kernels._dispatch_sizes(pairs, num_experts, block_m) if one_program else None
    classes = tuple(1 if v == 1 else 16 if v % 16 == 0 else 0 for v in (tokens, pairs, blocks))
    return block_m, str(sizes), classes


def test_every_step_size_launches_what_some_count_launched():
    for top_k, experts, budget in [(6, 64, 2048), (2, 8, 256), (8, 256, 1024)]:
        counts = specializing_token_counts(budget, top_k, experts)
        warmed = {launch(n, top_k, experts) for n in counts}
        assert len(warmed) == len(counts)  # one count per specialization, none twice
        assert all(launch(t, top_k, experts) in warmed for t in range(1, budget + 1))


def test_v2_lite_counts_cross_the_dispatch_boundaries():
    counts = specializing_token_counts(2048, 6, 64)
    assert {1, 342, 683} <= counts  # 342 x 6 pairs: a sort of 4096; 683 x 6: torch's sort
    assert max(counts) <= 2048
