"""Checkpoints of recurrent state at block boundaries, so prefix-cache hits work for hybrids.

A model with recurrent layers (a DeltaNet, a Mamba) cannot resume from cached KV blocks alone:
it also needs its state as it was after exactly those tokens. Core keeps a bounded pool of such
states in extra slots of the state arenas, each keyed by the hash of the last block of the
prefix it follows (block hashes chain the whole prefix, so the key names the prefix). A prompt
reuses the longest run of cached KV blocks that ends where a checkpoint exists; the scheduler
asks for a checkpoint where a prompt's last full block ends, and the model writes it during the
step that computes that position. Least recently used checkpoints make room for new ones.
"""

from __future__ import annotations

from collections import OrderedDict


class StateCheckpoints:
    """`capacity` checkpoint slots, numbered from `first_slot` in the state arenas."""

    def __init__(self, capacity: int, first_slot: int) -> None:
        self.capacity = capacity
        self._free = list(range(first_slot + capacity - 1, first_slot - 1, -1))
        self._published: OrderedDict[bytes, int] = OrderedDict()  # oldest use first
        self._pending: set[bytes] = set()
        self._handed_out: list[int] = []  # slots reserved since the last take_handed_out()
        self._held: dict[int, int] = {}  # slot -> requests about to restore from it

    def __len__(self) -> int:
        return len(self._published)

    def lookup(self, block_hashes: list[bytes], max_blocks: int) -> tuple[int, int] | None:
        """The longest prefix of at most `max_blocks` blocks with a checkpoint:
        (its length in blocks, the checkpoint's slot), or None."""
        for blocks in range(min(max_blocks, len(block_hashes)), 0, -1):
            slot = self._published.get(block_hashes[blocks - 1])
            if slot is not None:
                self._published.move_to_end(block_hashes[blocks - 1])
                return blocks, slot
        return None

    def get(self, block_hash: bytes) -> int | None:
        """The slot of the checkpoint that follows exactly this block, if published."""
        slot = self._published.get(block_hash)
        if slot is not None:
            self._published.move_to_end(block_hash)
        return slot

    def reserve(self, block_hash: bytes) -> int | None:
        """A slot to write the checkpoint that follows `block_hash` into, evicting the least
        recently used checkpoint nobody holds if none is free; None if it exists or is being
        written, or if every checkpoint is held."""
        if block_hash in self._published or block_hash in self._pending or self.capacity == 0:
            return None
        if not self._free:
            victim = next((h for h, slot in self._published.items() if slot not in self._held),
                          None)  # fmt: skip
            if victim is None:
                return None
            self._free.append(self._published.pop(victim))
        self._pending.add(block_hash)
        slot = self._free.pop()
        self._handed_out.append(slot)
        return slot

    def hold(self, slot: int) -> None:
        """A request will restore from this slot: it is not evicted until `release`."""
        self._held[slot] = self._held.get(slot, 0) + 1

    def release(self, slot: int) -> None:
        """The restore from this slot was launched (or will not happen)."""
        if self._held[slot] == 1:
            del self._held[slot]
        else:
            self._held[slot] -= 1

    def cancel(self, block_hash: bytes, slot: int) -> None:
        """A reservation that will not be written after all."""
        self._pending.discard(block_hash)
        self._free.append(slot)

    def take_handed_out(self) -> list[int]:
        """Slots reserved since the last call: their old contents may still be read (a copy to
        the host tier) when a step writes them."""
        slots, self._handed_out = self._handed_out, []
        return slots

    def publish(self, block_hash: bytes, slot: int) -> None:
        """The step that wrote `slot` ran: later prompts may restore from it."""
        self._pending.discard(block_hash)
        self._published[block_hash] = slot
