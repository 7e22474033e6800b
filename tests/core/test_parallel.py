"""Tensor-parallel building blocks: two gloo processes, each holding half of every weight,
compute what one process computes with the whole weights (float32)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from pegainfer.core.distributed import parallel
from pegainfer.core.ops.activation import silu_and_mul

HIDDEN, INTER, VOCAB = 32, 48, 64


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(VOCAB, HIDDEN, generator=g),
        "gate": torch.randn(INTER, HIDDEN, generator=g) * 0.2,
        "up": torch.randn(INTER, HIDDEN, generator=g) * 0.2,
        "down": torch.randn(HIDDEN, INTER, generator=g) * 0.2,
        "head": torch.randn(VOCAB, HIDDEN, generator=g) * 0.2,
    }


IDS = torch.tensor([3, 17, 40, 63, 0, 32, 31])


def reference() -> torch.Tensor:
    """Embedding, a SwiGLU MLP with a residual, the LM head: in one process."""
    w = weights()
    x = F.embedding(IDS, w["embed"])
    gate_up = F.linear(x, torch.cat((w["gate"], w["up"])))
    x = x + F.linear(silu_and_mul(gate_up), w["down"])
    return F.linear(x, w["head"])


def sharded(group: parallel.ParallelGroup) -> torch.Tensor:
    """The same with every weight split over the ranks, as a TP model line would load it."""
    w = weights()
    x = parallel.vocab_parallel_embedding(IDS, parallel.shard_rows(w["embed"], group), group)
    # gate and up are split separately, so each rank holds matching halves of both.
    gate_up = torch.cat([parallel.shard_rows(w[n], group) for n in ("gate", "up")])
    h = silu_and_mul(parallel.column_parallel_linear(x, gate_up))
    x = x + parallel.row_parallel_linear(h, parallel.shard_columns(w["down"], group), group)
    return parallel.vocab_parallel_logits(x, parallel.shard_rows(w["head"], group), group)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        logits = sharded(parallel.ParallelGroup(rank, world, dist.group.WORLD))
        torch.save(logits, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_equal_one(tmp_path):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    expected = reference()
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() <= 1e-5


def test_one_rank_needs_no_process_group():
    assert torch.equal(sharded(parallel.ParallelGroup()), reference())


def test_uneven_splits_are_refused():
    with pytest.raises(ValueError, match="does not split over 2 ranks"):
        parallel.ParallelGroup(0, 2).split(7)
