"""Our Qwen3 forward over paged KV equals transformers' logits (float32, max |Δ| ≤ 1e-4)."""

from __future__ import annotations

import pytest
import torch

from tests.paged_runner import (
    ForwardMatchesTransformers,
)
from tests.qwen3.hf_reference import VOCAB, load_hf, load_ours


@pytest.fixture(params=[True, False], ids=["tied", "untied"])
def models(request, hf_checkpoints):
    path = hf_checkpoints(request.param)
    return load_ours(path), load_hf(path)


class TestQwen3Forward(ForwardMatchesTransformers):
    VOCAB = VOCAB
    PREFILL_LENGTHS = (1, 5, 17, 40)
    CHUNKED_LENGTH, CHUNK_SIZES = 40, (7, 16, 1, 16)


def test_perturbed_norms_matter(hf_checkpoints):
    """Guard against a test that passes by accident: norms are not all 1."""
    ours = load_ours(hf_checkpoints(True))
    weights = torch.cat([layer.q_norm for layer in ours.layers] + [ours.norm])
    assert (weights - 1).abs().max() > 0.05
