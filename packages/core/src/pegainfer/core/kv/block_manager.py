"""KV-cache block bookkeeping: block ids, reference counts, a prefix cache and LRU eviction.

The manager hands out integer block ids in `[0, num_blocks)`; what a block holds (`block_size`
tokens' worth of K and V in every layer) is the model runner's business. A block holding a full,
computed block of tokens can be sealed under a chained hash of those tokens, so a later request
whose prompt starts with the same tokens reuses it instead of recomputing it. When its last user
releases a sealed block, the block stays cached in an LRU until its space is needed: `allocate`
hands out never-cached free blocks first, then evicts the least recently released cached ones.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

from pegainfer.core.kv.kv_events import BlockRemoved, BlockStored, KVEvent

BlockHash = bytes
"""16-byte digest naming a full block of tokens and, through the chain, every token before it."""

# Leading byte of every hashed message: a root block without salt, a root block with salt and a
# child block then always hash different byte strings, whatever their tokens.
_ROOT, _ROOT_SALTED, _CHILD = b"\x00", b"\x01", b"\x02"


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], salt: str | None = None
) -> BlockHash:
    """Hash one block of tokens chained onto the hash of the block before it (None for the first).

    Chaining makes a block's hash cover every token up to its end, so equal hashes mean equal
    prefixes, not merely equal blocks. The salt is folded into the first block only; it reaches the
    later blocks through the chain (as vLLM's `cache_salt` does), so requests with different salts
    never share blocks. `salt` is ignored when `parent` is given. blake2b over a fixed byte
    encoding (little-endian int64 tokens) keeps hashes equal across processes, unlike `hash()`.
    """
    return _hash_encoded(parent, struct.pack(f"<{len(token_ids)}q", *token_ids), salt)


def _hash_encoded(parent: BlockHash | None, encoded: bytes, salt: str | None) -> BlockHash:
    """`hash_block_tokens` of a block whose tokens are already encoded."""
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(_CHILD + parent)
    elif salt is None:
        h.update(_ROOT)
    else:
        salt_bytes = salt.encode()
        h.update(_ROOT_SALTED + struct.pack("<Q", len(salt_bytes)) + salt_bytes)
    h.update(encoded)
    return h.digest()


class BlockManager:
    """Hands out KV blocks and keeps the prefix cache. Not thread-safe: the scheduler owns it.

    Every block is in exactly one state:
    - free: refcount 0 and no cached hash, in `_free`;
    - evictable: refcount 0 with a cached hash, in `_evictable` (least recently released first);
    - in use: refcount > 0, with or without a cached hash.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_blocks: bool | None = None,
        record_events: bool = False,
    ) -> None:
        """`hash_blocks` (default: `enable_prefix_caching`) keeps block hashes even with the
        device cache off, for a host tier that caches alone. `record_events` keeps a log of the
        blocks the prefix cache gains and loses (`take_events`), for KV-event publishing."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks, block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_blocks = enable_prefix_caching if hash_blocks is None else hash_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[BlockHash, int] = {}
        self._block_to_hash: dict[int, BlockHash] = {}
        self._handed_out: list[int] = []  # since the last take_handed_out()
        if record_events and not enable_prefix_caching:
            raise ValueError("KV events describe the prefix cache: record_events needs it on")
        self.record_events = record_events
        self._events: list[KVEvent] = []  # since the last take_events()

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one user."""
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

    def extend_block_hashes(
        self, token_ids: Sequence[int], block_hashes: list[BlockHash], salt: str | None = None
    ) -> None:
        """Append the hashes of the full blocks of `token_ids` that `block_hashes` lacks.

        `block_hashes[i]` covers `token_ids[i * block_size:(i + 1) * block_size]`; a request calls
        this as its tokens grow, so each block is hashed once. A no-op without `hash_blocks`.
        """
        if not self.hash_blocks:
            return
        bs = self.block_size
        first, end = len(block_hashes), len(token_ids) // bs
        if end <= first:
            return
        # The new blocks' tokens encoded at once (as hash_block_tokens encodes one block).
        encoded = np.asarray(token_ids[first * bs : end * bs], dtype="<i8").tobytes()
        width = 8 * bs
        for i in range(end - first):
            parent = block_hashes[-1] if block_hashes else None
            block_hashes.append(_hash_encoded(parent, encoded[i * width : (i + 1) * width], salt))

    def match_prefix(self, block_hashes: Sequence[BlockHash], max_blocks: int) -> list[int]:
        """Return the blocks caching the longest run of leading hashes, at most `max_blocks`.

        Reference counts are untouched: `acquire` the result before the next `allocate`, which may
        otherwise evict a matched block that has no users.
        """
        if not self.enable_prefix_caching:
            return []
        looked_up = block_hashes[: max(max_blocks, 0)]
        hits: list[int] = []
        for block_hash in looked_up:
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Take a reference on each of `block_ids`, cached blocks that `match_prefix` returned."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                if block_id not in self._evictable:
                    raise RuntimeError(f"block {block_id} is neither in use nor cached")
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Return `num_blocks` fresh blocks with refcount 1, or None (changing nothing) if short.

        Never-cached free blocks go first, so cached prefixes survive as long as possible; then the
        least recently released cached blocks are evicted and their hashes forgotten.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            return None
        block_ids: list[int] = []
        for _ in range(num_blocks):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                evicted = self._block_to_hash.pop(block_id)
                del self._hash_to_block[evicted]
                if self.record_events:
                    self._record_removed(evicted)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        self._handed_out += block_ids
        return block_ids

    def take_events(self) -> list[KVEvent]:
        """The prefix cache's changes since the last call, in order (empty unless
        `record_events`): consecutive blocks sealed along one chain come as one `BlockStored`,
        consecutive evictions as one `BlockRemoved`, as vLLM reports them."""
        events, self._events = self._events, []
        return events

    def _record_stored(
        self, block_hash: BlockHash, parent: BlockHash | None, token_ids: Sequence[int]
    ) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent:
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
        else:
            self._events.append(BlockStored([block_hash], parent, list(token_ids), self.block_size))

    def _record_removed(self, block_hash: BlockHash) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash]))

    def take_handed_out(self) -> list[int]:
        """Blocks `allocate` returned since the last call (whose old contents a copy out to a
        host tier may still be reading)."""
        blocks, self._handed_out = self._handed_out, []
        return blocks

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each of `block_ids` (one sequence's blocks, in order).

        They are released tail first, so a sequence's tail enters the LRU before its head and is
        evicted first: the head is the part other requests are likeliest to share (as in vLLM).
        """
        for block_id in reversed(block_ids):
            ref = self._ref_counts[block_id]
            if ref == 0:
                raise RuntimeError(f"block {block_id} released more often than referenced")
            self._ref_counts[block_id] = ref - 1
            if ref == 1:
                if block_id in self._block_to_hash:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    def seal(
        self,
        block_id: int,
        block_hash: BlockHash,
        parent: BlockHash | None,
        token_ids: Sequence[int],
    ) -> None:
        """Cache a full, computed block in use under `block_hash` so later requests can hit it.

        `block_hash` chains `token_ids` (the block's tokens) onto `parent` (the previous block's
        hash, None for a sequence's first block); the two are what a `BlockStored` event reports.
        If another block already caches `block_hash`, that entry stays and this block remains an
        uncached duplicate, which returns to the free pool when released. Sealing a block again
        with the same hash is a no-op; with a different hash it is a bug (full blocks never change).
        A no-op when caching is off.
        """
        if not self.enable_prefix_caching:
            return
        if self._ref_counts[block_id] == 0:
            raise RuntimeError(f"block {block_id} is not in use and cannot be sealed")
        current = self._block_to_hash.get(block_id)
        if current is not None:
            if current != block_hash:
                raise RuntimeError(f"block {block_id} is already sealed under another hash")
            return
        if block_hash not in self._hash_to_block:
            self._hash_to_block[block_hash] = block_id
            self._block_to_hash[block_id] = block_hash
            if self.record_events:
                self._record_stored(block_hash, parent, token_ids)

    def check_invariants(self) -> None:
        """Raise AssertionError if the internal state is inconsistent. For tests; O(num_blocks)."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is in the free pool twice"
        assert not free & evictable, "a block is both free and evictable"
        assert len(free) + len(evictable) == self._ref_counts.count(0), "idle blocks mislaid"
        for block_id, ref in enumerate(self._ref_counts):
            assert ref >= 0, f"block {block_id} has refcount {ref}"
            assert (ref == 0) == (block_id in free or block_id in evictable), f"block {block_id}"
        assert not any(b in self._block_to_hash for b in free), "a free block has a hash"
        assert all(b in self._block_to_hash for b in evictable), "an evictable block has no hash"
        assert len(self._hash_to_block) == len(self._block_to_hash), "hash maps differ"
        assert all(self._block_to_hash.get(b) == h for h, b in self._hash_to_block.items())
        assert self.enable_prefix_caching or not self._hash_to_block, "caching off, hashes kept"
