"""Kimi-K2 through the engine (scheduler, latent blocks, sampler): greedy 32 tokens equal
transformers' `generate`, batched, chunked beside decodes, and from the prefix cache."""

from __future__ import annotations

import pytest
import torch

from tests.engine_harness import (
    both_schedulers,  # noqa: F401 (a fixture)
    check_prefix_hit_equals_cold,
    generate,
    greedy,
    hf_greedy,
    make_engine,
)
from tests.kimi_k2.hf_reference import VOCAB, load_hf, write_hf_checkpoint

pytestmark = pytest.mark.usefixtures("both_schedulers")
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = write_hf_checkpoint(tmp_path_factory.mktemp("kimi-engine"), seed=4)
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
