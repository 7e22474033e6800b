"""The host tier on CPU tensors: round trips, capacity, LRU, and a load racing an eviction."""

from __future__ import annotations

import torch

from pegainfer.core.kv.kv_cache import ArenaSpec, KVCache
from pegainfer.core.kv.kv_offload import HostMemoryTier

SPECS = [
    ArenaSpec("kv", 3, (2, 4, 2, 8), torch.float32),
    ArenaSpec("latent", 3, (4, 5), torch.bfloat16),
]
CPU = torch.device("cpu")


def filled_cache(num_blocks: int = 8) -> KVCache:
    cache = KVCache(SPECS, num_blocks, CPU)
    g = torch.Generator().manual_seed(0)
    for arena in cache.arenas.values():
        arena.copy_(torch.randn(arena.shape, generator=g).to(arena.dtype))
    return cache


def block(cache: KVCache, block_id: int) -> list[torch.Tensor]:
    return [cache[name][:, block_id].clone() for name in cache.arenas]


def test_a_block_comes_back_in_every_arena():
    cache, tier = filled_cache(), HostMemoryTier(SPECS, 4, CPU)
    original = block(cache, 3)
    tier.store([(b"h3", 3)], cache)
    for arena in cache.arenas.values():
        arena[:, 3] = 0
    assert tier.contains(b"h3") and not tier.contains(b"other")
    assert tier.ready(tier.load([(b"h3", 6)], cache))
    assert all(torch.equal(a, b) for a, b in zip(block(cache, 6), original, strict=True))


def test_capacity_is_allocated_up_front_and_never_exceeded():
    tier = HostMemoryTier(SPECS, 3, CPU)
    per_block = sum(s.bytes_per_block for s in SPECS)
    assert tier.nbytes == 3 * per_block
    assert sum(t.numel() * t.element_size() for t in tier.arenas.values()) == tier.nbytes
    cache = filled_cache()
    for i in range(8):
        tier.store([(bytes([i]), i)], cache)
        assert len(tier) <= 3
    assert [tier.contains(bytes([i])) for i in range(8)] == [False] * 5 + [True] * 3


def test_least_recently_used_goes_first():
    cache, tier = filled_cache(), HostMemoryTier(SPECS, 2, CPU)
    tier.store([(b"a", 0)], cache)
    tier.store([(b"b", 1)], cache)
    assert tier.contains(b"a")  # a use: b is now the oldest
    tier.store([(b"c", 2)], cache)
    assert tier.contains(b"a") and tier.contains(b"c") and not tier.contains(b"b")
    tier.evict(b"a")
    assert not tier.contains(b"a") and len(tier) == 1


def test_a_load_before_its_slot_is_reused_reads_the_old_block():
    """The restore of `a` reads its slot before the store that evicts it reuses the slot."""
    cache, tier = filled_cache(), HostMemoryTier(SPECS, 1, CPU)
    original = block(cache, 0)
    tier.store([(b"a", 0)], cache)
    tier.load([(b"a", 5)], cache)
    tier.store([(b"b", 1)], cache)  # evicts a and reuses its slot
    assert all(torch.equal(x, y) for x, y in zip(block(cache, 5), original, strict=True))
    assert not tier.contains(b"a") and tier.contains(b"b")


def test_blocks_cross_in_groups_whatever_the_order_of_their_host_slots():
    """A staging buffer of two blocks: stores and loads run in groups, and slots freed out of
    order make runs of one and of several consecutive slots."""
    per_block = max(s.bytes_per_block for s in SPECS)
    cache = filled_cache(num_blocks=12)
    tier = HostMemoryTier(SPECS, 6, CPU, staging_bytes=2 * per_block)
    originals = {b: block(cache, b) for b in range(12)}
    tier.store([(bytes([b]), b) for b in range(6)], cache)  # slots 0..5, groups of two
    for key in (b"\x01", b"\x04", b"\x02"):
        tier.evict(key)  # frees slots 1, 4, 2: the next stores take them in that order
    tier.store([(bytes([b]), b) for b in (7, 8, 9)], cache)
    stored = [0, 3, 5, 7, 8, 9]
    targets = [11, 2, 6, 0, 10, 4]  # device blocks, in no particular order
    for arena in cache.arenas.values():
        arena.zero_()
    tier.load([(bytes([b]), t) for b, t in zip(stored, targets, strict=True)], cache)
    for b, t in zip(stored, targets, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(block(cache, t), originals[b], strict=True))
    untouched = set(range(12)) - set(targets)
    assert all(not cache[name][:, b].any() for b in untouched for name in cache.arenas)
