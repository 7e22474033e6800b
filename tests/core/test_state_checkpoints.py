"""The pool of recurrent-state checkpoints: longest lookup, LRU eviction, one writer per key."""

from __future__ import annotations

from pegainfer.core.kv.state_checkpoints import StateCheckpoints


def hashes(n: int) -> list[bytes]:
    return [bytes([i]) * 4 for i in range(n)]


def test_lookup_finds_the_longest_checkpointed_prefix_within_the_limit():
    pool = StateCheckpoints(capacity=4, first_slot=10)
    h = hashes(6)
    for blocks in (2, 5):
        slot = pool.reserve(h[blocks - 1])
        assert slot is not None and 10 <= slot < 14
        pool.publish(h[blocks - 1], slot)
    assert pool.lookup(h, 6)[0] == 5
    assert pool.lookup(h, 4)[0] == 2  # the KV hit was shorter
    assert pool.lookup(h, 1) is None
    assert pool.lookup(hashes(1), 1) is None


def test_a_key_is_written_once_and_the_least_recently_used_makes_room():
    pool = StateCheckpoints(capacity=2, first_slot=0)
    h = hashes(3)
    a = pool.reserve(h[0])
    assert pool.reserve(h[0]) is None  # being written
    pool.publish(h[0], a)
    assert pool.reserve(h[0]) is None  # exists
    b = pool.reserve(h[1])
    pool.publish(h[1], b)
    assert {a, b} == {0, 1}
    pool.lookup(h[:1], 1)  # h[0] used again: h[1] is now the oldest
    c = pool.reserve(h[2])
    assert c == b and pool.lookup(h[:2], 2) == (1, a)
    pool.publish(h[2], c)
    assert len(pool) == 2


def test_no_capacity_means_no_checkpoints():
    pool = StateCheckpoints(capacity=0, first_slot=5)
    assert pool.reserve(b"x") is None and pool.lookup([b"x"], 1) is None


def test_a_held_checkpoint_is_not_evicted_until_released():
    """A request about to restore from a checkpoint holds it: reservations evict the next
    oldest instead, or get nothing while every checkpoint is held."""
    pool = StateCheckpoints(capacity=2, first_slot=0)
    h = hashes(4)
    a, b = pool.reserve(h[0]), pool.reserve(h[1])
    pool.publish(h[0], a)
    pool.publish(h[1], b)
    pool.hold(a)  # h[0], the oldest, is held
    c = pool.reserve(h[2])
    assert c == b and pool.get(h[0]) == a
    pool.publish(h[2], c)
    pool.hold(c)
    pool.hold(a)  # two requests on a
    assert pool.reserve(h[3]) is None
    pool.release(c)
    pool.release(a)
    assert pool.reserve(h[3]) == c  # a is still held once
    pool.release(a)
