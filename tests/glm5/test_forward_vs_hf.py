"""Our GLM-5 forward (paged latent and indexer-key caches, sparse attention past index_topk)
equals transformers' logits (float32, ≤ 1e-4) on prompts longer than index_topk."""

from __future__ import annotations

import pytest
import torch

from tests.glm5.hf_reference import SMALL, VOCAB, load_hf, load_ours, write_hf_checkpoint
from tests.paged_runner import (
    ForwardMatchesTransformers,
    PagedRunner,
    assert_close,
    hf_logits,
    random_tokens,
)

TOP_K = SMALL["index_topk"]


@pytest.fixture(scope="module", params=["full", "shared"])
def models(request, tmp_path_factory):
    """GLM-5's indexer in every layer, with an MTP layer's tensors in the checkpoint; and
    GLM-5.2's shared indexer layers (layers 2 and 4 reuse the selections of 1 and 3), with
    two groups of experts."""
    overrides = {"mtp": True}
    if request.param == "shared":
        overrides = {"indexer_types": ["full", "full", "shared", "full", "shared"],
                     "n_group": 2, "topk_group": 1}  # fmt: skip
    path = write_hf_checkpoint(tmp_path_factory.mktemp("glm5"), **overrides)
    return load_ours(path), load_hf(path)


class TestGlm5Forward(ForwardMatchesTransformers):
    VOCAB = VOCAB
    PREFILL_LENGTHS = (1, 5, TOP_K, 17, 70)
    DECODE_PREFILL = 5


def test_the_selection_matters_at_this_size(models):
    """Past index_topk tokens, sparse attention gives other logits than dense attention over
    every key (else these tests would not exercise the selection)."""
    _, hf = models
    tokens = random_tokens(40, 11, VOCAB)
    sparse = hf_logits(hf, tokens)
    hf.config.index_topk = 4096
    for layer in hf.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.index_topk = 4096
    try:
        dense = hf_logits(hf, tokens)
    finally:
        hf.config.index_topk = TOP_K
        for layer in hf.model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.index_topk = TOP_K
    assert torch.allclose(sparse[:TOP_K], dense[:TOP_K], atol=1e-5)
    assert (sparse[TOP_K:] - dense[TOP_K:]).abs().max() > 0.1


def test_the_tiny_writers_checkpoint_is_the_published_layout(tmp_path):
    """transformers reads what `pegainfer-tiny glm5` writes into the logits we compute."""
    from pegainfer.models.glm5.line import Glm5Line

    Glm5Line().write_tiny_checkpoint(tmp_path, seed=2)
    ours, hf = load_ours(tmp_path), load_hf(tmp_path)
    tokens = random_tokens(40, 9, 200)
    assert_close(PagedRunner(ours).step({"a": tokens})["a"], hf_logits(hf, tokens))
