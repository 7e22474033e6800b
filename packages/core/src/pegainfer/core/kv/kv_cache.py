"""KV arenas and state slots: the cache tensors a model line asks for.

A line describes what one block holds for one layer (GQA K and V, an MLA latent, ...); core
allocates `[num_layers, num_blocks, *block_shape]` for each arena, sizes the number of blocks
from the memory it may use, and hands block ids out through the block manager. Every arena
shares the same block ids, so one block table addresses all of them.

Recurrent layers keep instead a fixed-size state per sequence (a conv window, a DeltaNet
matrix): core allocates `[num_layers, num_slots, *slot_shape]` for each state and gives every
running sequence a slot (`Request.slot`) for its life.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pegainfer.core.errors import ModelLineError


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


@dataclass(frozen=True)
class StateSpec:
    """One per-sequence state tensor: `slot_shape` is what one sequence holds in one layer."""

    name: str
    num_layers: int
    slot_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def bytes_per_slot(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * math.prod(self.slot_shape) * itemsize


def bytes_per_block(specs: list[ArenaSpec]) -> int:
    return sum(spec.bytes_per_block for spec in specs)


def blocks_for_memory(specs: list[ArenaSpec], memory_bytes: int) -> int:
    """How many blocks fit in `memory_bytes`."""
    per_block = bytes_per_block(specs)
    if per_block <= 0:  # a model line's mistake, not the user's
        raise ModelLineError(
            f"the model line's kv_arenas() describe {per_block} bytes per block ({len(specs)} "
            "arenas): a line must describe at least one KV arena of non-empty blocks"
        )
    return memory_bytes // per_block


class KVCache:
    """The allocated arenas and states, by name."""

    def __init__(
        self,
        specs: list[ArenaSpec],
        num_blocks: int,
        device: torch.device,
        states: list[StateSpec] = (),
        num_slots: int = 0,
    ) -> None:
        self.specs = {spec.name: spec for spec in specs}
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.arenas = {
            spec.name: torch.zeros(
                (spec.num_layers, num_blocks, *spec.block_shape), dtype=spec.dtype, device=device
            )
            for spec in specs
        }
        self.state_names = [spec.name for spec in states]
        for spec in states:
            assert spec.name not in self.arenas, f"two cache tensors named {spec.name!r}"
            self.arenas[spec.name] = torch.zeros(
                (spec.num_layers, num_slots, *spec.slot_shape), dtype=spec.dtype, device=device
            )

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.arenas[name]

    def copy_states(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Every layer's state of slot `sources[i]` into slot `targets[i]` (on the device)."""
        for name in self.state_names:
            arena = self.arenas[name]
            arena.index_copy_(1, targets, arena.index_select(1, sources))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.arenas.values())
