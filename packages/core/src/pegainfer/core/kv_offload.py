"""The host tier of the prefix cache: sealed KV blocks kept in host memory, keyed by prefix hash.

When a prompt's prefix has left GPU memory but a copy of its blocks lives in the tier, the
blocks come back by copy instead of by recomputing the prefill. The scheduler decides what
moves (it owns the hashes and the device blocks); the tier holds the bytes. Every arena the
model declared is stored (K/V for GQA, a latent for MLA): a block's entry is its slice of each.

The tier sits behind `OffloadBackend`, so a store shared across machines can replace the
in-process host memory without touching the scheduler. Copies run on one side stream in the
order they were asked for: a load from a slot is always enqueued before the store that reuses
the slot after an eviction, so a restore racing an eviction reads the old bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict

import torch

from pegainfer.core.kv_cache import ArenaSpec, KVCache, bytes_per_block

BlockHash = bytes


class OffloadBackend(ABC):
    """Where blocks go when they leave the GPU: store, load, contains, evict, by prefix hash."""

    @abstractmethod
    def contains(self, block_hash: BlockHash) -> bool:
        """Whether `load` can bring this block back (counts as a use for eviction order)."""

    @abstractmethod
    def store(self, block_hash: BlockHash, cache: KVCache, block_id: int) -> None:
        """Keep a copy of device block `block_id` (every arena) under `block_hash`."""

    @abstractmethod
    def load(self, block_hash: BlockHash, cache: KVCache, block_id: int) -> None:
        """Copy the stored block into device block `block_id`; the next step sees it."""

    @abstractmethod
    def evict(self, block_hash: BlockHash) -> None:
        """Forget a stored block."""

    @abstractmethod
    def before_step(self) -> None:
        """Order the step's GPU work after every copy asked for so far."""


class HostMemoryTier(OffloadBackend):
    """`capacity` blocks of pinned host memory (allocated up front), least recently used out."""

    def __init__(self, specs: list[ArenaSpec], capacity: int, device: torch.device) -> None:
        if capacity < 1:
            raise ValueError(f"the host tier needs room for a block, got capacity {capacity}")
        cuda = device.type == "cuda"
        self.capacity = capacity
        # Slot-major, so each stored block is one contiguous run of host memory (one DMA).
        self.arenas = {
            spec.name: torch.empty(
                (capacity, spec.num_layers, *spec.block_shape), dtype=spec.dtype, pin_memory=cuda
            )
            for spec in specs
        }
        self.nbytes = capacity * bytes_per_block(specs)
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._free = list(range(capacity - 1, -1, -1))
        self._stream = torch.cuda.Stream(device) if cuda else None

    def __len__(self) -> int:
        return len(self._slots)

    def contains(self, block_hash: BlockHash) -> bool:
        if block_hash not in self._slots:
            return False
        self._slots.move_to_end(block_hash)
        return True

    def store(self, block_hash: BlockHash, cache: KVCache, block_id: int) -> None:
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return
        if not self._free:
            _, slot = self._slots.popitem(last=False)
            self._free.append(slot)
        slot = self._free.pop()
        self._slots[block_hash] = slot
        self._copy(lambda name: (self.arenas[name][slot], cache[name][:, block_id]))

    def load(self, block_hash: BlockHash, cache: KVCache, block_id: int) -> None:
        slot = self._slots[block_hash]
        self._slots.move_to_end(block_hash)
        self._copy(lambda name: (cache[name][:, block_id], self.arenas[name][slot]))

    def evict(self, block_hash: BlockHash) -> None:
        slot = self._slots.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def before_step(self) -> None:
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)

    def _copy(self, pair) -> None:
        """Copy every arena's block (`pair(name)` gives destination and source), on the side
        stream after the GPU work queued so far, or at once on the CPU."""
        if self._stream is None:
            for name in self.arenas:
                dst, src = pair(name)
                dst.copy_(src)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            for name in self.arenas:
                dst, src = pair(name)
                dst.copy_(src, non_blocking=True)
