"""The all-to-all expert exchange over two or three gloo ranks computes, for each rank's own
tokens, what one process holding every expert does: tokens that need no remote expert, tokens
that need several ranks, ranks with fewer tokens than the capacity."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pegainfer.core.distributed.expert_parallel import exchange
from pegainfer.core.distributed.parallel import ParallelGroup
from tests.core.test_parallel import free_port

HIDDEN, EXPERTS, TOP_K = 8, 6, 2


def expert_weights() -> torch.Tensor:
    return torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(1))


def linear_experts(first: int, weights_of: torch.Tensor):
    """compute() for experts `first`.. held here: expert e maps x to weights_of[e] @ x."""

    def compute(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for k in range(experts.shape[1]):
            local = experts[:, k].long() - first
            held = (local >= 0) & (local < weights_of.shape[0])
            y = torch.einsum("toi,ti->to", weights_of[local.clamp(0, weights_of.shape[0] - 1)], x)
            out += torch.where(held[:, None], y * weights[:, k, None], 0.0)
        return out

    return compute


def rank_inputs(rank: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(tokens, HIDDEN, generator=g)
    experts = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
    if tokens:
        experts[0] = torch.tensor([0, 1])  # the first rank's experts only
        experts[-1] = torch.tensor([5, 4])  # the last rank's only
    weights = torch.rand(tokens, TOP_K, generator=g)
    return x, weights, experts.int()  # as the CUDA router gives them


def _worker(rank: int, port: int, sizes: tuple[int, ...], dtype: torch.dtype, out: str) -> None:
    world = len(sizes)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        x, weights, experts = rank_inputs(rank, sizes[rank])
        per_rank = EXPERTS // world
        mine = expert_weights()[rank * per_rank : (rank + 1) * per_rank].to(dtype)
        x = x.to(dtype)
        got = exchange(x, weights, experts, per_rank, max(sizes), ParallelGroup(rank, world),
                       linear_experts(rank * per_rank, mine))  # fmt: skip
        torch.save(got, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("sizes", "dtype"), [
    ((5, 5), torch.float32), ((7, 2), torch.float32), ((1, 9), torch.float32),
    ((7, 2), torch.bfloat16), ((4, 8, 1), torch.float32),
])  # fmt: skip
def test_the_exchange_equals_every_expert_in_one_process(tmp_path, sizes, dtype):
    """In bfloat16 the experts' ids and weights travel as pairs of bf16 columns."""
    mp.spawn(_worker, args=(free_port(), sizes, dtype, str(tmp_path)), nprocs=len(sizes),
             join=True)  # fmt: skip
    for rank in range(len(sizes)):
        x, weights, experts = rank_inputs(rank, sizes[rank])
        expected = linear_experts(0, expert_weights())(x, weights, experts)
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got.shape == expected.shape and got.dtype == dtype
        tolerance = 1e-5 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)
