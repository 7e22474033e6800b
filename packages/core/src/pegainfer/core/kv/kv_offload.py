"""The host tier of the prefix cache: sealed KV blocks kept in host memory, keyed by prefix hash.

When a prompt's prefix has left GPU memory but a copy of its blocks lives in the tier, the
blocks come back by copy instead of by recomputing the prefill. The scheduler decides what
moves (it owns the hashes and the device blocks); the tier holds the bytes. Every arena the
model declared is stored (K/V for GQA, a latent for MLA): a block's entry is its slice of each.

Models with recurrent state (Qwen3.5) also need the state checkpoint where a reused prefix
ends: the tier keeps copies of those too, keyed by the hash of the block the checkpoint follows,
in a second pool of the state arenas' slot shape.

The tier sits behind `OffloadBackend`, so a store shared across machines can replace the
in-process host memory without touching the scheduler. Loads are asynchronous: a restoring
request waits (holding its blocks) while the others keep running, and computes once its blocks
have landed; alone, it computes at once, its step ordered after the copies on the device.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections import OrderedDict

import torch

from pegainfer.core.kv.kv_cache import ArenaSpec, KVCache, StateSpec, bytes_per_block

BlockHash = bytes


class OffloadBackend(ABC):
    """Where blocks go when they leave the GPU: store, load, contains, evict, by prefix hash.

    Loads are asynchronous: `load` returns a transfer that the scheduler polls with `ready`
    before the request computes; `wait` orders later GPU work after it without blocking the
    host (a request computing at once, one that leaves while its blocks are still arriving,
    or another prompt hitting those blocks).
    """

    @abstractmethod
    def contains(self, block_hash: BlockHash) -> bool:
        """Whether `load` can bring this block back (counts as a use for eviction order)."""

    @abstractmethod
    def store(self, blocks: list[tuple[BlockHash, int]], cache: KVCache) -> None:
        """Keep copies of device blocks (every arena): (hash, device block) pairs."""

    @abstractmethod
    def contains_state(self, block_hash: BlockHash) -> bool:
        """Whether a state checkpoint following this block is stored (counts as a use)."""

    @abstractmethod
    def store_states(self, checkpoints: list[tuple[BlockHash, int]], cache: KVCache) -> None:
        """Keep copies of state checkpoints: (hash of the block they follow, state slot) pairs."""

    @abstractmethod
    def load(
        self,
        blocks: list[tuple[BlockHash, int]],
        cache: KVCache,
        states: list[tuple[BlockHash, int]] = (),
    ) -> Transfer:
        """Start copying stored blocks into device blocks, (hash, device block) pairs, and
        stored checkpoints into state slots, (hash, slot) pairs."""

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
    def before_step(self, reused_blocks: list[int], reused_slots: list[int] = ()) -> None:
        """Order the step's GPU work after the stores still reading any of `reused_blocks` or
        `reused_slots` (device blocks and checkpoint slots handed out again since the last
        step); other stores keep running."""


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
    a load first waits for the stores still writing the slots it reads (a prefix stored one
    step and restored the next); a step waits only for the stores of device blocks it was
    handed again.

    Blocks cross in groups through a device staging buffer per direction (`staging_bytes`,
    taken from the headroom memory sizing leaves): one copy per run of consecutive host slots
    and one gather or scatter launch per group and arena (`kernels.block_copy`). A block's
    slice of an arena is strided on the device (`[layers, blocks, ...]`), so copying it
    directly costs a temporary, a copy and a kernel per block and arena: at 16k tokens of
    Qwen3-4B, 2,048 of each.
    """

    def __init__(
        self,
        specs: list[ArenaSpec],
        capacity: int,
        device: torch.device,
        states: list[StateSpec] = (),
        state_capacity: int = 0,
        staging_bytes: int = 32 << 20,
    ) -> None:
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
        self.state_arenas = {
            spec.name: torch.empty(
                (state_capacity, spec.num_layers, *spec.slot_shape),
                dtype=spec.dtype,
                pin_memory=cuda,
            )
            for spec in states
        }
        self.state_capacity = state_capacity if states else 0
        self.nbytes = capacity * bytes_per_block(specs) + self.state_capacity * sum(
            spec.bytes_per_slot for spec in states
        )
        largest = max(spec.bytes_per_block for spec in specs)
        self._group = max(1, min(capacity, staging_bytes // largest))
        # Rounded to 16 bytes, so the buffer views as any arena's dtype.
        staging = -(-self._group * largest // 16) * 16
        self._load_staging = torch.empty(staging, dtype=torch.uint8, device=device)
        self._store_staging = torch.empty_like(self._load_staging)
        self._positions = torch.arange(self._group, device=device)  # rows of a staging buffer
        if cuda:
            from pegainfer.core.kernels.block_copy import copy_blocks
        else:
            from pegainfer.core.ops.block_copy import copy_blocks
        self._copy_blocks = copy_blocks
        self._blocks = _Pool(capacity)
        self._states = _Pool(self.state_capacity)
        self._device = device if cuda else None
        self._store_stream = torch.cuda.Stream(device) if cuda else None
        self._load_stream = torch.cuda.Stream(device) if cuda else None
        self._storing: dict[int, torch.cuda.Event] = {}  # device block -> its store's event
        self._storing_slots: dict[int, torch.cuda.Event] = {}  # device state slot -> its store

    def __len__(self) -> int:
        return len(self._blocks)

    def contains(self, block_hash: BlockHash) -> bool:
        return self._blocks.touch(block_hash)

    def store(self, blocks: list[tuple[BlockHash, int]], cache: KVCache) -> None:
        copies = self._claim(self._blocks, blocks)
        if not copies:
            return
        with self._on(self._store_stream):
            self._blocks_out(copies, cache)
        self._record(self._blocks, self._storing, copies)

    def contains_state(self, block_hash: BlockHash) -> bool:
        return self._states.touch(block_hash)

    def store_states(self, checkpoints: list[tuple[BlockHash, int]], cache: KVCache) -> None:
        copies = self._claim(self._states, checkpoints)
        if not copies:
            return
        with self._on(self._store_stream):
            for slot, index in copies:  # a few per step, each a whole slot of every state
                for name, arena in self.state_arenas.items():
                    arena[slot].copy_(cache[name][:, index], non_blocking=True)
        self._record(self._states, self._storing_slots, copies)

    def _claim(self, pool: _Pool, entries: list[tuple[BlockHash, int]]) -> list[tuple[int, int]]:
        """Host slots for the entries not stored yet, (host slot, device index) pairs. A host
        slot still read by a load is overwritten only after it."""
        copies = []
        for key, index in entries:
            if pool.touch(key):
                continue
            slot = pool.take(key)
            self._after(self._store_stream, pool.reading.pop(slot, None))
            copies.append((slot, index))
        return copies

    def _record(
        self, pool: _Pool, storing: dict[int, torch.cuda.Event], copies: list[tuple[int, int]]
    ) -> None:
        """Remember the store just queued: per device index, as still reading it; per host
        slot, as still writing it (a load of that slot must come after)."""
        if self._store_stream is not None:
            event = torch.cuda.Event()
            event.record(self._store_stream)
            storing.update(dict.fromkeys((index for _, index in copies), event))
            pool.writing.update(dict.fromkeys((slot for slot, _ in copies), event))

    def _blocks_out(self, copies: list[tuple[int, int]], cache: KVCache) -> None:
        """Device blocks to host slots, a group at a time: gather into the staging buffer,
        then one copy per run of consecutive host slots."""
        for group in _groups(copies, self._group):
            index = self._index([block for _, block in group])
            for name, host in self.arenas.items():
                stage = self._stage(self._store_staging, host, len(group))
                self._copy_blocks(cache[name], index, stage.transpose(0, 1),
                                  self._positions[: len(group)])  # fmt: skip
                for first, slot, count in _runs([slot for slot, _ in group]):
                    host[slot : slot + count].copy_(stage[first : first + count],
                                                    non_blocking=True)  # fmt: skip

    def _blocks_in(self, copies: list[tuple[int, int]], cache: KVCache) -> None:
        """Host slots to device blocks, a group at a time: one copy per run of consecutive
        host slots into the staging buffer, then one scatter launch per arena."""
        for group in _groups(copies, self._group):
            index = self._index([block for _, block in group])
            for name, host in self.arenas.items():
                stage = self._stage(self._load_staging, host, len(group))
                for first, slot, count in _runs([slot for slot, _ in group]):
                    stage[first : first + count].copy_(host[slot : slot + count],
                                                       non_blocking=True)  # fmt: skip
                self._copy_blocks(stage.transpose(0, 1), self._positions[: len(group)],
                                  cache[name], index)  # fmt: skip

    @staticmethod
    def _stage(buffer: torch.Tensor, host: torch.Tensor, count: int) -> torch.Tensor:
        """The first `count` host-slot shapes of the staging buffer, in the arena's dtype."""
        shape = (count, *host.shape[1:])
        return buffer.view(host.dtype)[: math.prod(shape)].view(shape)

    def _index(self, blocks: list[int]) -> torch.Tensor:
        """Device block ids as a device tensor, copied without blocking the host."""
        ids = torch.tensor(blocks, dtype=torch.int64)
        if self._device is None:
            return ids
        return ids.pin_memory().to(self._device, non_blocking=True)

    def load(
        self,
        blocks: list[tuple[BlockHash, int]],
        cache: KVCache,
        states: list[tuple[BlockHash, int]] = (),
    ) -> Transfer:
        slots = [self._blocks.get(block_hash) for block_hash, _ in blocks]
        state_slots = [self._states.get(block_hash) for block_hash, _ in states]
        # After the stores still writing the host slots it reads, and those still reading the
        # device blocks and slots it overwrites (their old contents on the way out).
        waits = [self._blocks.writing.get(slot) for slot in slots]
        waits += [self._states.writing.get(slot) for slot in state_slots]
        waits += [self._storing.pop(block, None) for _, block in blocks]
        waits += [self._storing_slots.pop(slot, None) for _, slot in states]
        for event in {id(e): e for e in waits if e is not None}.values():
            self._after(self._load_stream, event)
        with self._on(self._load_stream):
            self._blocks_in(list(zip(slots, (block for _, block in blocks), strict=True)), cache)
            for slot, (_, device_slot) in zip(state_slots, states, strict=True):
                for name, arena in self.state_arenas.items():
                    cache[name][:, device_slot].copy_(arena[slot], non_blocking=True)
        if self._load_stream is None:
            return Transfer()
        event = torch.cuda.Event()
        event.record(self._load_stream)
        self._blocks.reading.update(dict.fromkeys(slots, event))
        self._states.reading.update(dict.fromkeys(state_slots, event))
        return Transfer(event)

    def ready(self, transfer: Transfer) -> bool:
        return transfer.done

    def wait(self, transfer: Transfer) -> None:
        if transfer.event is not None:
            torch.cuda.current_stream(self._device).wait_event(transfer.event)

    def evict(self, block_hash: BlockHash) -> None:
        self._blocks.drop(block_hash)

    def before_step(self, reused_blocks: list[int], reused_slots: list[int] = ()) -> None:
        if self._store_stream is None:
            return
        main = torch.cuda.current_stream(self._device)
        waits = {id(e): e for b in reused_blocks if (e := self._storing.pop(b, None)) is not None}
        waits |= {id(e): e for s in reused_slots if (e := self._storing_slots.pop(s, None))}
        for event in waits.values():
            main.wait_event(event)
        if len(self._storing) > 4 * self.capacity:  # forget stores that have landed
            self._storing = {b: e for b, e in self._storing.items() if not e.query()}

    @staticmethod
    def _after(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)

    def _on(self, stream: torch.cuda.Stream | None):
        """Run copies on `stream` after the GPU work queued so far (at once on the CPU)."""
        if stream is None:
            return contextlib.nullcontext()
        stream.wait_stream(torch.cuda.current_stream(self._device))
        return torch.cuda.stream(stream)


def _groups(items: list, size: int) -> list[list]:
    return [items[start : start + size] for start in range(0, len(items), size)]


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive slots: (position in `slots`, first slot, length). Blocks stored
    together take consecutive slots while the pool's free list allows, so a prefix stored in
    one go comes back in a few large copies."""
    runs: list[tuple[int, int, int]] = []
    for position, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            first, start, count = runs[-1]
            runs[-1] = (first, start, count + 1)
        else:
            runs.append((position, slot, 1))
    return runs


class _Pool:
    """Host slots by key, least recently used first, evicted when full; and, per slot, the
    copies in flight on it (CUDA events): the last load reading it, the store writing it."""

    def __init__(self, capacity: int) -> None:
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))
        self.reading: dict[int, torch.cuda.Event] = {}
        self.writing: dict[int, torch.cuda.Event] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def touch(self, key: BlockHash) -> bool:
        if key not in self._slots:
            return False
        self._slots.move_to_end(key)
        return True

    def get(self, key: BlockHash) -> int:
        self._slots.move_to_end(key)
        return self._slots[key]

    def drop(self, key: BlockHash) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def take(self, key: BlockHash) -> int:
        """A slot for `key`, the least recently used one's if none is free."""
        if not self._free:
            _, slot = self._slots.popitem(last=False)
            self._free.append(slot)
        slot = self._free.pop()
        self._slots[key] = slot
        return slot
