"""DeepSeek-V2 through the engine (scheduler, latent blocks, sampler) against transformers."""

from __future__ import annotations

import pytest
import torch

from tests.deepseek.hf_reference import VOCAB, load_hf, write_hf_checkpoint
from tests.engine_harness import (
    both_schedulers,  # noqa: F401 (a fixture)
    check_host_tier_hit_equals_cold,
    check_prefix_hit_equals_cold,
    generate,
    greedy,
    hf_greedy,
    make_engine,
)

pytestmark = pytest.mark.usefixtures("both_schedulers")
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = write_hf_checkpoint(tmp_path_factory.mktemp("deepseek-engine"), seed=4)
    hf = load_hf(path)
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 6, 19, 40, 77)]
    return path, batch, [hf_greedy(hf, p, NEW_TOKENS) for p in batch]


def test_greedy_batch_equals_transformers(reference):
    path, batch, expected = reference
    assert generate(make_engine(path), batch, greedy(NEW_TOKENS)) == expected


def test_chunked_prefill_beside_decodes(reference):
    path, batch, expected = reference
    engine = make_engine(path, max_num_batched_tokens=16, enable_chunked_prefill=True)
    assert generate(engine, batch, greedy(NEW_TOKENS)) == expected


def test_prefix_cache_hit_equals_cold(reference):
    """The second request reuses the first one's latent blocks (all but the last)."""
    path, batch, expected = reference
    check_prefix_hit_equals_cold(path, batch[-1], expected[-1])


def test_latent_blocks_restored_from_the_host_tier_equal_cold(reference):
    """The host tier stores MLA's two arenas (latent and rope key) like GQA's K/V: with the
    device prefix cache off, a repeated prompt's blocks come back from host memory."""
    path, batch, expected = reference
    check_host_tier_hit_equals_cold(path, batch[-1], expected[-1], {"ckv", "kpe"})
