"""The host tier of the prefix cache: sealed KV blocks kept in host memory, keyed by prefix hash.

When a prompt's prefix has left GPU memory but a copy of its blocks lives in the tier, the
blocks come back by copy instead of by recomputing the prefill. The scheduler decides what
moves (it owns the hashes and the device blocks); the tier holds the bytes. Every arena the
model declared is stored (K/V for GQA, a latent for MLA): a block's entry is its slice of each.

The tier sits behind `OffloadBackend`, so a store shared across machines can replace the
in-process host memory without touching the scheduler. Loads are asynchronous: a restoring
request waits (holding its blocks) while the others keep running, and computes once its blocks
have landed.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections import OrderedDict

import torch

from pegainfer.core.kv_cache import ArenaSpec, KVCache, bytes_per_block

BlockHash = bytes


class OffloadBackend(ABC):
    """Where blocks go when they leave the GPU: store, load, contains, evict, by prefix hash.

    Loads are asynchronous: `load` returns a transfer that the scheduler polls with `ready`
    before the request computes; `wait` orders later GPU work after it without blocking the
    host (for a request that leaves while its blocks are still arriving).
    """

    @abstractmethod
    def contains(self, block_hash: BlockHash) -> bool:
        """Whether `load` can bring this block back (counts as a use for eviction order)."""

    @abstractmethod
    def store(self, blocks: list[tuple[BlockHash, int]], cache: KVCache) -> None:
        """Keep copies of device blocks (every arena): (hash, device block) pairs."""

    @abstractmethod
    def load(self, blocks: list[tuple[BlockHash, int]], cache: KVCache) -> Transfer:
        """Start copying stored blocks into device blocks: (hash, device block) pairs."""

    @abstractmethod
    def ready(self, transfer: Transfer) -> bool:
        """Whether a load has landed, so steps may read its blocks."""

    @abstractmethod
    def wait(self, transfer: Transfer) -> None:
        """Order the GPU work queued from now on after this load."""

    @abstractmethod
    def evict(self, block_hash: BlockHash) -> None:
        """Forget a stored block."""

    @abstractmethod
    def before_step(self, reused_blocks: list[int]) -> None:
        """Order the step's GPU work after the stores still reading any of `reused_blocks`
        (device blocks handed out again since the last step); other stores keep running."""


class Transfer:
    """A load in flight: done at once on the CPU, an event on the GPU."""

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self.event = event

    @property
    def done(self) -> bool:
        return self.event is None or self.event.query()


class HostMemoryTier(OffloadBackend):
    """`capacity` blocks of pinned host memory (allocated up front), least recently used out.

    Stores and loads run on two side streams. A store that reuses an evicted slot first waits
    for the loads still reading that slot, so a restore racing an eviction reads the old block;
    a step waits only for the stores of device blocks it was handed again.
    """

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
        self._device = device if cuda else None
        self._store_stream = torch.cuda.Stream(device) if cuda else None
        self._load_stream = torch.cuda.Stream(device) if cuda else None
        self._reading: dict[int, torch.cuda.Event] = {}  # slot -> the last load reading it
        self._storing: dict[int, torch.cuda.Event] = {}  # device block -> its store's event

    def __len__(self) -> int:
        return len(self._slots)

    def contains(self, block_hash: BlockHash) -> bool:
        if block_hash not in self._slots:
            return False
        self._slots.move_to_end(block_hash)
        return True

    def store(self, blocks: list[tuple[BlockHash, int]], cache: KVCache) -> None:
        copies = []
        for block_hash, block_id in blocks:
            if block_hash in self._slots:
                self._slots.move_to_end(block_hash)
                continue
            if not self._free:
                _, slot = self._slots.popitem(last=False)
                self._free.append(slot)
            slot = self._free.pop()
            self._slots[block_hash] = slot
            reading = self._reading.pop(slot, None)
            if reading is not None and self._store_stream is not None:
                self._store_stream.wait_event(reading)
            copies.append((slot, block_id))
        if not copies:
            return
        with self._on(self._store_stream):
            for slot, block_id in copies:
                for name, arena in self.arenas.items():
                    arena[slot].copy_(cache[name][:, block_id], non_blocking=True)
        if self._store_stream is not None:
            event = torch.cuda.Event()
            event.record(self._store_stream)
            self._storing.update(dict.fromkeys((block_id for _, block_id in copies), event))

    def load(self, blocks: list[tuple[BlockHash, int]], cache: KVCache) -> Transfer:
        slots = []
        for block_hash, block_id in blocks:
            slots.append(self._slots[block_hash])
            self._slots.move_to_end(block_hash)
            # The target block's old contents may still be on their way out to the tier.
            storing = self._storing.pop(block_id, None)
            if storing is not None and self._load_stream is not None:
                self._load_stream.wait_event(storing)
        with self._on(self._load_stream):
            for slot, (_, block_id) in zip(slots, blocks, strict=True):
                for name, arena in self.arenas.items():
                    cache[name][:, block_id].copy_(arena[slot], non_blocking=True)
        if self._load_stream is None:
            return Transfer()
        event = torch.cuda.Event()
        event.record(self._load_stream)
        for slot in slots:
            self._reading[slot] = event
        return Transfer(event)

    def ready(self, transfer: Transfer) -> bool:
        return transfer.done

    def wait(self, transfer: Transfer) -> None:
        if transfer.event is not None:
            torch.cuda.current_stream(self._device).wait_event(transfer.event)

    def evict(self, block_hash: BlockHash) -> None:
        slot = self._slots.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def before_step(self, reused_blocks: list[int]) -> None:
        if self._store_stream is None:
            return
        main = torch.cuda.current_stream(self._device)
        waits = {id(e): e for b in reused_blocks if (e := self._storing.pop(b, None)) is not None}
        for event in waits.values():
            main.wait_event(event)
        if len(self._storing) > 4 * self.capacity:  # forget stores that have landed
            self._storing = {b: e for b, e in self._storing.items() if not e.query()}

    def _on(self, stream: torch.cuda.Stream | None):
        """Run copies on `stream` after the GPU work queued so far (at once on the CPU)."""
        if stream is None:
            return contextlib.nullcontext()
        stream.wait_stream(torch.cuda.current_stream(self._device))
        return torch.cuda.stream(stream)
