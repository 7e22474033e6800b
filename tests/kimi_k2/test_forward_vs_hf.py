"""Our Kimi-K2 / DeepSeek-V3 forward (paged latent cache) equals transformers' logits (float32,
≤ 1e-4)."""

from __future__ import annotations

import pytest

from tests.kimi_k2.hf_reference import GROUPED, VOCAB, load_hf, load_ours, write_hf_checkpoint
from tests.paged_runner import (
    ForwardMatchesTransformers,
    PagedRunner,
    assert_close,
    hf_logits,
    random_tokens,
)


@pytest.fixture(scope="module", params=["kimi", "grouped"])
def models(request, tmp_path_factory):
    """Kimi-K2's structure (model_type kimi_k2); and DeepSeek-V3's grouped routing with a tied
    head (model_type deepseek_v3)."""
    path = tmp_path_factory.mktemp("kimi")
    if request.param == "grouped":
        write_hf_checkpoint(path, model_type="deepseek_v3", **GROUPED)
    else:
        write_hf_checkpoint(path)
    return load_ours(path), load_hf(path)


class TestKimiK2Forward(ForwardMatchesTransformers):
    VOCAB = VOCAB


def test_routing_is_not_degenerate_and_the_bias_matters(models):
    """Tokens of one prompt spread over most experts, and the correction bias changes some of
    their choices (else the MoE check proves little)."""
    import torch

    ours, _ = models
    layer = ours.layers[1].mlp
    x = ours.embed_tokens[random_tokens(64, 1, VOCAB)]
    _, chosen = layer.route(x)
    assert len(chosen.unique()) >= 6
    bias = layer.e_score_correction_bias
    assert bias.dtype == torch.float32 and bias.abs().min() > 0
    layer.e_score_correction_bias = torch.nn.Parameter(torch.zeros_like(bias),
                                                       requires_grad=False)  # fmt: skip
    try:
        _, unbiased = layer.route(x)
    finally:
        layer.e_score_correction_bias = bias
    assert not torch.equal(chosen.sort(dim=1).values, unbiased.sort(dim=1).values)


def test_the_tiny_writers_checkpoint_is_the_published_layout(tmp_path):
    """transformers reads what `pegainfer-tiny kimi-k2` writes (rope_scaling and rope_theta
    as the published config has them, experts one by one, a float32 correction bias) into the
    logits we compute."""
    from pegainfer.models.kimi_k2.line import KimiK2Line

    KimiK2Line().write_tiny_checkpoint(tmp_path, seed=2)
    ours, hf = load_ours(tmp_path), load_hf(tmp_path)
    tokens = random_tokens(33, 9, 200)
    assert_close(PagedRunner(ours).step({"a": tokens})["a"], hf_logits(hf, tokens))
