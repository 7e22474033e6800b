"""Tests for the KV block manager: allocation, reference counts, prefix cache and eviction."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pegainfer.core.kv.block_manager import BlockManager, hash_block_tokens
from pegainfer.core.kv.kv_events import BlockRemoved, BlockStored


def hashes_of(bm: BlockManager, tokens: list[int], salt: str | None = None) -> list[bytes]:
    block_hashes: list[bytes] = []
    bm.extend_block_hashes(tokens, block_hashes, salt)
    return block_hashes


def run_request(bm: BlockManager, tokens: list[int], salt: str | None = None) -> list[int]:
    """Serve `tokens` as the scheduler will: reuse the cached prefix, compute and seal the rest."""
    block_hashes = hashes_of(bm, tokens, salt)
    cached = bm.match_prefix(block_hashes, max_blocks=(len(tokens) - 1) // bm.block_size)
    bm.acquire(cached)
    fresh = bm.allocate(-(-len(tokens) // bm.block_size) - len(cached))
    assert fresh is not None
    blocks = cached + fresh
    bs = bm.block_size
    for i, (block_id, block_hash) in enumerate(zip(blocks, block_hashes, strict=False)):
        bm.seal(
            block_id, block_hash, block_hashes[i - 1] if i else None, tokens[i * bs : (i + 1) * bs]
        )
    bm.check_invariants()
    return blocks


# ---------------------------------------------------------------------------------------------
# Unit tests
# ---------------------------------------------------------------------------------------------


def test_allocate_release_round_trip() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    blocks = bm.allocate(3)
    assert blocks is not None
    assert len(set(blocks)) == 3 and all(0 <= b < 4 for b in blocks)
    assert bm.num_free_blocks == 1
    assert bm.usage == 0.75
    bm.check_invariants()
    bm.release(blocks)
    assert bm.num_free_blocks == 4
    assert bm.usage == 0.0
    assert sorted(bm.allocate(4) or []) == [0, 1, 2, 3]
    bm.check_invariants()


def test_allocate_is_all_or_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    held = bm.allocate(3)
    assert held is not None
    assert bm.allocate(2) is None
    assert bm.num_free_blocks == 1
    assert bm.allocate(0) == []
    last = bm.allocate(1)
    assert last is not None and last[0] not in held
    assert bm.allocate(1) is None
    bm.check_invariants()


def test_prefix_hit_after_seal_and_release() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(10))  # two full blocks and a partial one
    first = run_request(bm, prompt)
    bm.release(first)
    assert bm.num_free_blocks == 8  # cached blocks still count as allocatable

    # The same prompt plus more tokens reuses both full blocks, in order.
    block_hashes = hashes_of(bm, [*prompt, 10, 11, 12])
    assert len(block_hashes) == 3
    cached = bm.match_prefix(block_hashes, max_blocks=3)
    assert cached == first[:2]
    bm.acquire(cached)
    assert bm.num_free_blocks == 6
    assert bm.usage == 2 / 8
    bm.check_invariants()

    # max_blocks caps the match (the scheduler keeps at least one token to compute).
    assert bm.match_prefix(block_hashes, max_blocks=1) == first[:1]
    assert bm.match_prefix(block_hashes, max_blocks=0) == []


def test_a_different_block_breaks_the_chain() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.release(run_request(bm, [1, 2, 3, 4, 5, 6, 7]))
    # Block 1 differs, so block 2 misses too even though its own tokens are equal.
    assert len(bm.match_prefix(hashes_of(bm, [1, 2, 0, 0, 5, 6, 7]), 3)) == 1


def test_salt_separates_caches() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    bm.release(run_request(bm, tokens, salt="alice"))
    assert len(bm.match_prefix(hashes_of(bm, tokens, salt="alice"), 2)) == 2
    assert bm.match_prefix(hashes_of(bm, tokens, salt="bob"), 2) == []
    assert bm.match_prefix(hashes_of(bm, tokens), 2) == []
    assert hashes_of(bm, tokens, salt="") != hashes_of(bm, tokens)


def test_caching_off_means_no_hits() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    tokens = [1, 2, 3, 4, 5]
    assert hashes_of(bm, tokens) == []
    blocks = bm.allocate(3)
    assert blocks is not None
    bm.seal(blocks[0], hash_block_tokens(None, tokens[:2]), None, tokens[:2])
    bm.release(blocks)
    assert bm.match_prefix([hash_block_tokens(None, tokens[:2])], 1) == []
    bm.check_invariants()


def test_eviction_is_lru_and_tail_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=1)
    a = run_request(bm, [1, 2, 3])  # three sealed blocks
    b = run_request(bm, [7, 8, 9])
    bm.release(a)  # released first: evicted first, tail before head
    bm.release(b)
    assert bm.num_free_blocks == 6
    assert bm.allocate(1) == [a[2]]
    assert bm.allocate(2) == [a[1], a[0]]
    assert bm.allocate(1) == [b[2]]
    # Evicted hashes are gone, the rest still hit.
    assert bm.match_prefix(hashes_of(bm, [1, 2, 3]), 3) == []
    assert bm.match_prefix(hashes_of(bm, [7, 8, 9]), 3) == b[:2]
    bm.check_invariants()


def test_free_blocks_are_used_before_cached_ones() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    cached = run_request(bm, [1, 2, 3, 4])
    bm.release(cached)
    fresh = bm.allocate(2)
    assert fresh is not None and not set(fresh) & set(cached)
    assert bm.match_prefix(hashes_of(bm, [1, 2, 3, 4]), 2) == cached


def test_acquired_block_is_not_evicted() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    first = run_request(bm, [1, 2, 3, 4, 5, 6])
    bm.release(first)
    cached = bm.match_prefix(hashes_of(bm, [1, 2, 3, 4]), 1)
    bm.acquire(cached)
    others = bm.allocate(2)
    assert others is not None and cached[0] not in others
    assert bm.allocate(1) is None
    assert bm.match_prefix(hashes_of(bm, [1, 2, 3, 4]), 2) == cached  # block 1 was evicted


def test_sealed_duplicate_does_not_replace_original() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    block_hash = hash_block_tokens(None, [5, 6])
    original, duplicate = bm.allocate(2) or []
    bm.seal(original, block_hash, None, [5, 6])
    bm.seal(duplicate, block_hash, None, [5, 6])  # computed concurrently by another request
    bm.seal(original, block_hash, None, [5, 6])  # sealing again is a no-op
    assert bm.match_prefix([block_hash], 1) == [original]
    bm.release([duplicate])  # uncached: straight back to the free pool
    bm.release([original])  # cached: evictable
    bm.check_invariants()
    assert bm.allocate(3) == [2, 3, duplicate]  # free blocks before the cached original
    assert bm.match_prefix([block_hash], 1) == [original]


def test_sealing_with_another_hash_or_unowned_raises() -> None:
    bm = BlockManager(num_blocks=2, block_size=1)
    (block,) = bm.allocate(1) or []
    bm.seal(block, hash_block_tokens(None, [1]), None, [1])
    with pytest.raises(RuntimeError):
        bm.seal(block, hash_block_tokens(None, [2]), None, [2])
    with pytest.raises(RuntimeError):
        bm.seal(1 - block, hash_block_tokens(None, [3]), None, [3])


def test_releasing_a_free_block_raises() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    blocks = bm.allocate(1)
    assert blocks is not None
    bm.release(blocks)
    with pytest.raises(RuntimeError):
        bm.release(blocks)
    with pytest.raises(RuntimeError):
        bm.release([1])  # never allocated


def test_acquiring_an_uncached_free_block_raises() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    with pytest.raises(RuntimeError):
        bm.acquire([0])


def test_invalid_sizes_are_rejected() -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=16)
    with pytest.raises(ValueError):
        BlockManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError):
        BlockManager(num_blocks=4, block_size=2).allocate(-1)


# ---------------------------------------------------------------------------------------------
# Hashing
# ---------------------------------------------------------------------------------------------


def test_hash_is_a_16_byte_digest_stable_across_processes() -> None:
    digest = hash_block_tokens(hash_block_tokens(None, [1, 2**40], salt="s"), [3, 4])
    assert isinstance(digest, bytes) and len(digest) == 16
    code = (
        "from pegainfer.core.kv.block_manager import hash_block_tokens as h;"
        "print(h(h(None, [1, 2**40], salt='s'), [3, 4]).hex())"
    )
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.pathsep.join(sys.path)}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == digest.hex()


def test_extend_block_hashes_is_incremental() -> None:
    bm = BlockManager(num_blocks=1, block_size=3)
    tokens = list(range(11))
    grown: list[bytes] = []
    for end in range(len(tokens) + 1):
        bm.extend_block_hashes(tokens[:end], grown, salt="x")
        assert len(grown) == end // 3
    assert grown == hashes_of(bm, tokens, salt="x")
    expected, parent = [], None
    for i in range(3):
        parent = hash_block_tokens(parent, tokens[3 * i : 3 * i + 3], "x" if i == 0 else None)
        expected.append(parent)
    assert grown == expected


salts = st.sampled_from([None, "", "a", "b"])


@settings(max_examples=300, deadline=None)
@given(
    block_size=st.integers(1, 4),
    common=st.lists(st.integers(0, 2), max_size=10),
    tails=st.tuples(*[st.lists(st.integers(0, 2), max_size=10)] * 2),
    salt_pair=st.tuples(salts, salts),
)
def test_hashes_equal_iff_prefixes_and_salts_equal(
    block_size: int,
    common: list[int],
    tails: tuple[list[int], list[int]],
    salt_pair: tuple[str | None, str | None],
) -> None:
    bm = BlockManager(num_blocks=1, block_size=block_size)
    a, b = common + tails[0], common + tails[1]
    ha, hb = hashes_of(bm, a, salt_pair[0]), hashes_of(bm, b, salt_pair[1])
    assert len(ha) == len(a) // block_size and len(hb) == len(b) // block_size
    for i in range(min(len(ha), len(hb))):
        end = (i + 1) * block_size
        same = a[:end] == b[:end] and salt_pair[0] == salt_pair[1]
        assert (ha[i] == hb[i]) == same


# ---------------------------------------------------------------------------------------------
# Stateful model test
# ---------------------------------------------------------------------------------------------


@dataclass
class Owner:
    """A live user of blocks: a request (tokens, hashes) or a bare allocation (no tokens)."""

    blocks: list[int]
    block_hashes: list[bytes] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives a BlockManager with random requests and checks it against a plain model.

    The model tracks each owner's blocks and which hash each block caches; the manager must agree
    with it on reference counts, free capacity and prefix matches after every step.
    """

    def __init__(self) -> None:
        super().__init__()
        self.owners: dict[int, Owner] = {}
        self.next_owner = 0
        self.cache: dict[bytes, int] = {}  # model of the prefix cache: hash -> block id
        # The prefix cache as its KV events tell it (hash -> parent, tokens), and every hash
        # seen stored with its tokens: a hash, once stored, always names the same tokens.
        self.from_events: dict[bytes, tuple[bytes | None, list[int]]] = {}

    @initialize(num_blocks=st.integers(1, 10), block_size=st.integers(1, 3), caching=st.booleans())
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.bm = BlockManager(
            num_blocks, block_size, enable_prefix_caching=caching, record_events=caching
        )

    # -- helpers ------------------------------------------------------------------------------

    def referenced(self) -> Counter[int]:
        return Counter(b for owner in self.owners.values() for b in owner.blocks)

    def add_owner(self, owner: Owner) -> None:
        self.owners[self.next_owner] = owner
        self.next_owner += 1

    def checked_allocate(self, n: int) -> list[int] | None:
        referenced = self.referenced()
        cached_blocks = set(self.cache.values())
        idle_uncached = self.bm.num_blocks - len(referenced | Counter(cached_blocks))
        free_before = self.bm.num_free_blocks
        blocks = self.bm.allocate(n)
        if blocks is None:
            assert n > free_before
            assert self.bm.num_free_blocks == free_before
            return None
        assert len(blocks) == n == len(set(blocks))
        assert not set(blocks) & referenced.keys(), "handed out a block in use"
        evicted = set(blocks) & cached_blocks
        assert len(evicted) == max(0, n - idle_uncached), "evicted while free blocks remained"
        self.cache = {h: b for h, b in self.cache.items() if b not in evicted}
        return blocks

    def pick(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.owners)))

    # -- rules --------------------------------------------------------------------------------

    @rule(n=st.integers(0, 11))
    def allocate(self, n: int) -> None:
        blocks = self.checked_allocate(n)
        if blocks is not None:
            self.add_owner(Owner(blocks))

    @rule(tokens=st.lists(st.integers(0, 1), max_size=12), salt=st.sampled_from([None, "s"]))
    def start_request(self, tokens: list[int], salt: str | None) -> None:
        bm = self.bm
        block_hashes = hashes_of(bm, tokens, salt)
        num_full = len(tokens) // bm.block_size
        assert len(block_hashes) == (num_full if bm.enable_prefix_caching else 0)
        max_blocks = max(len(tokens) - 1, 0) // bm.block_size
        expected: list[int] = []
        for block_hash in block_hashes[:max_blocks]:
            if block_hash not in self.cache:
                break
            expected.append(self.cache[block_hash])
        cached = bm.match_prefix(block_hashes, max_blocks)
        assert cached == expected
        bm.acquire(cached)
        self.add_owner(
            Owner(cached, block_hashes, tokens)
        )  # owns its prefix even if allocate fails
        fresh = self.checked_allocate(-(-len(tokens) // bm.block_size) - len(cached))
        if fresh is None:
            self.release(self.next_owner - 1)
        else:
            self.owners[self.next_owner - 1].blocks += fresh

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def seal(self, data: st.DataObject) -> None:
        owner = self.owners[self.pick(data)]
        bs = self.bm.block_size
        for i, (block_id, block_hash) in enumerate(
            zip(owner.blocks, owner.block_hashes, strict=False)
        ):
            parent = owner.block_hashes[i - 1] if i else None
            self.bm.seal(block_id, block_hash, parent, owner.tokens[i * bs : (i + 1) * bs])
            if block_hash not in self.cache and block_id not in self.cache.values():
                self.cache[block_hash] = block_id
        # Every full block's hash is now cached, by this owner's block or an earlier one.
        n = len(owner.block_hashes)
        assert len(self.bm.match_prefix(owner.block_hashes, n)) == n

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def release_owner(self, data: st.DataObject) -> None:
        self.release(self.pick(data))

    def release(self, owner_id: int) -> None:
        self.bm.release(self.owners.pop(owner_id).blocks)

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        bm = self.bm
        bm.check_invariants()
        referenced = self.referenced()
        refcounts = bm._ref_counts
        assert sum(refcounts) == sum(len(o.blocks) for o in self.owners.values())
        assert refcounts == [referenced[b] for b in range(bm.num_blocks)]
        idle = set(bm._free) | set(bm._evictable)
        assert not idle & referenced.keys(), "a block is both idle and referenced"
        assert bm.num_free_blocks == bm.num_blocks - len(referenced)
        assert 0.0 <= bm.usage <= 1.0
        assert bm.usage == len(referenced) / bm.num_blocks
        assert bm._hash_to_block == self.cache
        self.replay_events()
        assert self.from_events.keys() == self.cache.keys()

    def replay_events(self) -> None:
        """Apply the block manager's KV events to `from_events`, checking each against the
        state it changes: stored blocks were not cached, chain onto their parent and hash to
        what their tokens and parent give; removed blocks were cached."""
        bs = self.bm.block_size
        for event in self.bm.take_events():
            if isinstance(event, BlockStored):
                assert event.block_size == bs
                assert len(event.token_ids) == bs * len(event.block_hashes)
                parent = event.parent_block_hash
                for i, block_hash in enumerate(event.block_hashes):
                    tokens = event.token_ids[i * bs : (i + 1) * bs]
                    assert block_hash not in self.from_events, "stored twice without removal"
                    # Unsalted chains hash to their tokens; salted roots fold in a salt.
                    if parent is not None:
                        assert hash_block_tokens(parent, tokens) == block_hash
                    self.from_events[block_hash] = (parent, tokens)
                    parent = block_hash
            else:
                assert isinstance(event, BlockRemoved)
                for block_hash in event.block_hashes:
                    assert self.from_events.pop(block_hash, None) is not None, "removed, not stored"

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for owner_id in sorted(self.owners):
            self.release(owner_id)
        self.consistent()
        assert all(ref == 0 for ref in self.bm._ref_counts)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.bm.usage == 0.0


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None
)
TestBlockManagerMachine = BlockManagerMachine.TestCase


def test_hashes_extended_in_bulk_equal_one_block_at_a_time():
    """extend_block_hashes encodes a prompt's new blocks at once: the digests stay those of
    hash_block_tokens chained block by block (salt in the first block), however the prompt
    grows."""
    blocks = BlockManager(8, 4, True, hash_blocks=True)
    tokens = [7, -3, 2**40, 0, 5, 5, 5, 5, 1, 2, 3, 4, 9]
    for salt in (None, "tenant"):
        grown: list[bytes] = []
        for end in (3, 6, 13):
            blocks.extend_block_hashes(tokens[:end], grown, salt)
        chained, parent = [], None
        for i in range(len(tokens) // 4):
            parent = hash_block_tokens(parent, tokens[4 * i : 4 * i + 4], salt)
            chained.append(parent)
        assert grown == chained
