"""Our Qwen3 forward over paged KV equals transformers' logits (float32, max |Δ| ≤ 1e-4)."""

from __future__ import annotations

import pytest
import torch

from tests.paged_runner import PagedRunner
from tests.qwen3.hf_reference import VOCAB, load_hf, load_ours

TOL = 1e-4


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"max |Δlogit| = {diff:.3g} > {TOL}"


@pytest.fixture(params=[True, False], ids=["tied", "untied"])
def models(request, hf_checkpoints):
    path = hf_checkpoints(request.param)
    return load_ours(path), load_hf(path)


@pytest.mark.parametrize("length", [1, 5, 17, 40])
def test_prefill(models, length):
    ours, hf = models
    tokens = random_tokens(length, seed=length)
    logits = PagedRunner(ours).step({"a": tokens})["a"]
    assert_close(logits, hf_logits(hf, tokens))


def test_chunked_prefill(models):
    ours, hf = models
    tokens = random_tokens(40, seed=7)
    runner, start = PagedRunner(ours), 0
    reference = hf_logits(hf, tokens)
    for size in (7, 16, 1, 16):
        logits = runner.step({"a": tokens[start : start + size]})["a"]
        assert_close(logits, reference[start : start + size])
        start += size


def test_token_by_token_decode(models):
    ours, hf = models
    tokens = random_tokens(24, seed=3)
    runner = PagedRunner(ours)
    reference = hf_logits(hf, tokens)
    assert_close(runner.step({"a": tokens[:10]})["a"], reference[:10])
    for pos in range(10, 24):
        assert_close(runner.step({"a": [tokens[pos]]})["a"], reference[pos : pos + 1])


def test_mixed_batch(models):
    """Fresh prefills of different lengths, a mid-prompt chunk and decodes in one step."""
    ours, hf = models
    seqs = {
        name: random_tokens(n, seed=i)
        for i, (name, n) in enumerate([("p1", 3), ("p2", 21), ("chunk", 30), ("d1", 9), ("d2", 14)])
    }
    refs = {name: hf_logits(hf, tokens) for name, tokens in seqs.items()}
    runner = PagedRunner(ours)
    runner.step({"chunk": seqs["chunk"][:11], "d1": seqs["d1"][:8], "d2": seqs["d2"][:13]})
    step = {
        "p1": seqs["p1"],
        "d1": seqs["d1"][8:9],
        "chunk": seqs["chunk"][11:30],
        "p2": seqs["p2"],
        "d2": seqs["d2"][13:14],
    }
    out = runner.step(step)
    assert_close(out["p1"], refs["p1"])
    assert_close(out["p2"], refs["p2"])
    assert_close(out["chunk"], refs["chunk"][11:30])
    assert_close(out["d1"], refs["d1"][8:9])
    assert_close(out["d2"], refs["d2"][13:14])


def test_perturbed_norms_matter(hf_checkpoints):
    """Guard against a test that passes by accident: norms are not all 1."""
    ours = load_ours(hf_checkpoints(True))
    weights = torch.cat([layer.q_norm for layer in ours.layers] + [ours.norm])
    assert (weights - 1).abs().max() > 0.05
