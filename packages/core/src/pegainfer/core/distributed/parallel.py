"""Tensor parallelism's building blocks on torch.distributed (NCCL on GPUs, gloo on the CPU).

One process per rank holds a slice of each sharded weight, as Megatron-LM splits them:
- column-parallel: the output features split across ranks (q/k/v and gate/up projections); each
  rank computes its slice of the output, which stays sharded for the next op;
- row-parallel: the input features split (o and down projections); each rank computes a partial
  sum of the full output, and an all-reduce adds them;
- vocab-parallel: the embedding's rows split; a rank looks up the ids it owns (zeros for the
  rest) and an all-reduce assembles the rows; the LM head's rows split likewise, and an
  all-gather assembles the logits.

Weights are sliced from the full checkpoint tensors with `shard_rows`/`shard_columns`, so each
rank reads only the bytes it keeps (safetensors slices lazily).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pegainfer.core.errors import ConfigError
from pegainfer.core.quant.linear import Weight, linear

C = TypeVar("C")


@dataclass(frozen=True)
class ParallelGroup:
    """This process's place among a set of ranks, tensor-parallel or (attention)
    data-parallel (world 1: no communication)."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def gather_rows(self, x: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
        """Every rank's `x` [rows[rank], ...] concatenated in rank order, on every rank (each
        padded to the most rows for the all-gather)."""
        if self.world_size == 1:
            return x
        padded = x.new_zeros(max(*rows, 1), *x.shape[1:])  # NCCL gets no empty buffers
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([part[:n] for part, n in zip(parts, rows, strict=True)])

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x [world * n, ...]: rows [p * n, (p + 1) * n) go to rank p; the result's block p
        holds what rank p sent here."""
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=self.group)
        return out

    def split(self, size: int) -> tuple[int, int]:
        """This rank's [start, end) of `size` items split evenly (`size` must divide)."""
        if size % self.world_size:
            raise ValueError(f"{size} does not split over {self.world_size} ranks")
        per = size // self.world_size
        return self.rank * per, (self.rank + 1) * per


def shard_config(cfg: C, group: ParallelGroup, split: tuple[str, ...], **also: int) -> C:
    """`cfg` as one rank sees it: the fields named in `split` divided by the world size. Those
    and the sizes in `also` (which stay whole in the config, e.g. the vocabulary, split only in
    the weights) must divide evenly, or a ConfigError names the first that does not."""
    world = group.world_size
    sizes: dict[str, Any] = {name: getattr(cfg, name) for name in split} | also
    for name, size in sizes.items():
        if size % world:
            raise ConfigError(f"{name} {size} does not split over {world} ranks")
    return dataclasses.replace(cfg, **{name: sizes[name] // world for name in split})


def shard_rows(weight: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """This rank's rows of a [out, in] weight (column-parallel linear, vocab-parallel tables)."""
    start, end = group.split(weight.shape[0])
    return weight[start:end]


def shard_columns(weight: torch.Tensor, group: ParallelGroup) -> torch.Tensor:
    """This rank's columns of a [out, in] weight (row-parallel linear)."""
    start, end = group.split(weight.shape[1])
    return weight[:, start:end]


def column_parallel_linear(x: torch.Tensor, shard: Weight) -> torch.Tensor:
    """x [.., in] by this rank's rows of W (plain or quantized): this rank's slice of the
    output features."""
    return linear(x, shard)


def row_parallel_linear(x_slice: torch.Tensor, shard: Weight, group: ParallelGroup) -> torch.Tensor:
    """This rank's slice of the input features by its columns of W (plain or quantized),
    summed over the ranks: the full output on every rank."""
    return group.all_reduce(linear(x_slice, shard))


def vocab_parallel_embedding(
    ids: torch.Tensor, shard: torch.Tensor, group: ParallelGroup
) -> torch.Tensor:
    """Embedding rows for `ids` when this rank holds rows [start, end) of the table."""
    if group.world_size == 1:
        return F.embedding(ids, shard)
    start, end = group.split(shard.shape[0] * group.world_size)
    mine = (ids >= start) & (ids < end)
    rows = F.embedding((ids - start).clamp(0, end - start - 1), shard)
    return group.all_reduce(rows * mine[..., None].to(rows.dtype))


def vocab_parallel_logits(
    x: torch.Tensor,
    shard: torch.Tensor,
    group: ParallelGroup,
    matmul: Callable[[torch.Tensor, Weight], torch.Tensor] = linear,
) -> torch.Tensor:
    """Logits over the whole vocabulary from this rank's rows of the LM head (`matmul`: a
    `dense.DenseOps`' head)."""
    return group.all_gather_last(matmul(x, shard))
