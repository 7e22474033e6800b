"""The host tier's stream ordering on a GPU (CUDA; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.kv.kv_cache import ArenaSpec, KVCache
from pegainfer.core.kv.kv_offload import HostMemoryTier

pytestmark = pytest.mark.gpu

# Qwen3-4B's block: 36 layers of 16 tokens x 8 KV heads x 128, K and V (2.25 MiB).
SPECS = [ArenaSpec("kv", 36, (2, 16, 8, 128), torch.bfloat16)]


def test_a_load_right_after_the_store_of_its_blocks_reads_what_was_stored():
    """Store 400 blocks and, without waiting, restore the same hashes into other device
    blocks: each load must come after the store writing its host slot. Then again after the
    blocks left the device, and once with the staging buffer split into many groups."""
    n, cuda = 400, torch.device("cuda")
    for staging in (32 << 20, 3 * SPECS[0].bytes_per_block):
        cache = KVCache(SPECS, 2 * n + 1, cuda)
        arena = cache["kv"]
        arena.normal_()
        tier = HostMemoryTier(SPECS, n, cuda, staging_bytes=staging)
        keys = [i.to_bytes(4, "little") for i in range(n)]
        sources, targets = list(range(n)), list(range(n, 2 * n))
        tier.store(list(zip(keys, sources, strict=True)), cache)
        tier.wait(tier.load(list(zip(keys, targets, strict=True)), cache))
        torch.cuda.synchronize()
        assert torch.equal(arena[:, n : 2 * n], arena[:, :n])
        expected = arena[:, :n].clone()
        arena.zero_()
        tier.wait(tier.load(list(zip(keys, sources, strict=True)), cache))
        torch.cuda.synchronize()
        assert torch.equal(arena[:, :n], expected)
