"""Our Qwen3 forward over paged KV equals transformers' logits (float32, max |Δ| ≤ 1e-4)."""

from __future__ import annotations

import pytest
import torch

from tests.paged_runner import (
    PagedRunner,
    assert_close,
    check_chunked_prefill,
    check_mixed_batch,
    check_token_by_token_decode,
    hf_logits,
    random_tokens,
)
from tests.qwen3.hf_reference import VOCAB, load_hf, load_ours


@pytest.fixture(params=[True, False], ids=["tied", "untied"])
def models(request, hf_checkpoints):
    path = hf_checkpoints(request.param)
    return load_ours(path), load_hf(path)


@pytest.mark.parametrize("length", [1, 5, 17, 40])
def test_prefill(models, length):
    ours, hf = models
    tokens = random_tokens(length, length, VOCAB)
    assert_close(PagedRunner(ours).step({"a": tokens})["a"], hf_logits(hf, tokens))


def test_chunked_prefill(models):
    check_chunked_prefill(*models, random_tokens(40, 7, VOCAB), (7, 16, 1, 16))


def test_token_by_token_decode(models):
    check_token_by_token_decode(*models, random_tokens(24, 3, VOCAB), prefill=10)


def test_mixed_batch(models):
    check_mixed_batch(*models, VOCAB)


def test_perturbed_norms_matter(hf_checkpoints):
    """Guard against a test that passes by accident: norms are not all 1."""
    ours = load_ours(hf_checkpoints(True))
    weights = torch.cat([layer.q_norm for layer in ours.layers] + [ours.norm])
    assert (weights - 1).abs().max() > 0.05
