"""KV arenas: the cache tensors a model line asks for, described per block.

A line describes what one block holds for one layer (GQA K and V, an MLA latent, ...); core
allocates `[num_layers, num_blocks, *block_shape]` for each arena, sizes the number of blocks
from the memory it may use, and hands block ids out through the block manager. Every arena
shares the same block ids, so one block table addresses all of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ArenaSpec:
    """One cache tensor: `block_shape` is what one block of one layer holds."""

    name: str
    num_layers: int
    block_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across every layer of this arena."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * math.prod(self.block_shape) * itemsize


def bytes_per_block(specs: list[ArenaSpec]) -> int:
    return sum(spec.bytes_per_block for spec in specs)


def blocks_for_memory(specs: list[ArenaSpec], memory_bytes: int) -> int:
    """How many blocks fit in `memory_bytes`."""
    return memory_bytes // bytes_per_block(specs)


class KVCache:
    """The allocated arenas, by name."""

    def __init__(self, specs: list[ArenaSpec], num_blocks: int, device: torch.device) -> None:
        self.specs = {spec.name: spec for spec in specs}
        self.num_blocks = num_blocks
        self.arenas = {
            spec.name: torch.zeros(
                (spec.num_layers, num_blocks, *spec.block_shape), dtype=spec.dtype, device=device
            )
            for spec in specs
        }

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.arenas[name]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.arenas.values())
