"""GLM-5 through the engine (scheduler, latent and indexer-key blocks, sampler) against
transformers: greedy continuations past index_topk, chunked, from the prefix cache and from
the host tier."""

from __future__ import annotations

import pytest
import torch

from tests.engine_harness import (
    both_schedulers,  # noqa: F401 (a fixture)
    check_host_tier_hit_equals_cold,
    check_prefix_hit_equals_cold,
    generate,
    greedy,
    hf_greedy,
    make_engine,
)
from tests.glm5.hf_reference import VOCAB, load_hf, write_hf_checkpoint

pytestmark = pytest.mark.usefixtures("both_schedulers")
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = write_hf_checkpoint(tmp_path_factory.mktemp("glm5-engine"), seed=4)
    hf = load_hf(path)
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 6, 19, 40)]
    return path, batch, [hf_greedy(hf, p, NEW_TOKENS) for p in batch]


def test_greedy_batch_equals_transformers(reference):
    path, batch, expected = reference
    assert generate(make_engine(path), batch, greedy(NEW_TOKENS)) == expected


def test_chunked_prefill_beside_decodes(reference):
    path, batch, expected = reference
    engine = make_engine(path, max_num_batched_tokens=16, enable_chunked_prefill=True)
    assert generate(engine, batch, greedy(NEW_TOKENS)) == expected


def test_prefix_cache_hit_equals_cold(reference):
    """The second request reuses the first one's latent and indexer-key blocks."""
    path, batch, expected = reference
    check_prefix_hit_equals_cold(path, batch[-1], expected[-1])


def test_blocks_restored_from_the_host_tier_equal_cold(reference):
    """The host tier stores the indexer keys beside the latents: with the device prefix cache
    off, a repeated prompt's blocks come back from host memory."""
    path, batch, expected = reference
    check_host_tier_hit_equals_cold(path, batch[-1], expected[-1], {"ckv", "kpe", "index_k"})
