"""Our DeepSeek-V2 forward (paged latent cache) equals transformers' logits (float32, ≤ 1e-4)."""

from __future__ import annotations

import pytest

from tests.deepseek.hf_reference import VOCAB, load_hf, load_ours, write_hf_checkpoint
from tests.paged_runner import (
    ForwardMatchesTransformers,
    PagedRunner,
    assert_close,
    hf_logits,
    random_tokens,
)


@pytest.fixture(scope="module", params=["lite", "q_lora_group_limited"])
def models(request, tmp_path_factory):
    """V2-Lite's structure; and V2's q-LoRA with group-limited routing and a tied head."""
    overrides = {}
    if request.param != "lite":
        overrides = {"q_lora_rank": 24, "topk_method": "group_limited_greedy", "n_group": 4,
                     "topk_group": 2, "tie_word_embeddings": True,
                     "routed_scaling_factor": 1.5}  # fmt: skip
    path = write_hf_checkpoint(tmp_path_factory.mktemp("deepseek"), **overrides)
    return load_ours(path), load_hf(path)


class TestDeepseekV2Forward(ForwardMatchesTransformers):
    VOCAB = VOCAB


def test_routing_is_not_degenerate(models):
    """Tokens of one prompt spread over most experts (else the MoE check proves little)."""
    ours, _ = models
    layer = ours.layers[1].mlp
    x = ours.embed_tokens[random_tokens(64, 1, VOCAB)]
    _, chosen = layer.route(x)
    assert len(chosen.unique()) >= 6


def test_the_tiny_writers_checkpoint_is_the_published_layout(tmp_path):
    """transformers reads what `pegainfer-tiny deepseek` writes (rope_scaling and rope_theta
    as the published config has them, experts one by one) into the logits we compute."""
    from pegainfer.models.deepseek.line import DeepseekLine

    DeepseekLine().write_tiny_checkpoint(tmp_path, seed=2)
    ours, hf = load_ours(tmp_path), load_hf(tmp_path)
    tokens = random_tokens(33, 9, 200)
    assert_close(PagedRunner(ours).step({"a": tokens})["a"], hf_logits(hf, tokens))
