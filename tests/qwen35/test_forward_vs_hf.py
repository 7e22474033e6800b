"""Our Qwen3.5 forward (paged KV + state slots) equals transformers' logits (float32, ≤ 1e-4)."""

from __future__ import annotations

import pytest
import torch

from tests.paged_runner import PagedRunner
from tests.qwen35.hf_reference import VOCAB, load_hf, load_ours, write_hf_checkpoint

TOL = 1e-4


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def models(request, tmp_path_factory):
    path = write_hf_checkpoint(tmp_path_factory.mktemp("qwen35"), tie=request.param)
    return load_ours(path), load_hf(path)


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"max |Δlogit| = {diff:.3g} > {TOL}"


@pytest.mark.parametrize("length", [1, 5, 17, 70, 150])
def test_prefill(models, length):
    """One chunk; 70 and 150 tokens span several 64-token DeltaNet chunks."""
    ours, hf = models
    tokens = random_tokens(length, seed=length)
    assert_close(PagedRunner(ours).step({"a": tokens})["a"], hf_logits(hf, tokens))


def test_chunked_prefill_continues_from_saved_state(models):
    ours, hf = models
    tokens = random_tokens(100, seed=7)
    runner, start = PagedRunner(ours), 0
    reference = hf_logits(hf, tokens)
    for size in (7, 66, 1, 26):
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
    """Fresh prefills, a mid-prompt chunk and decodes in one step, each in its own slot."""
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


def test_a_reused_slot_starts_from_a_clean_state(models):
    """A sequence that starts in a slot another sequence used gets nothing of its state."""
    ours, hf = models
    first, second = random_tokens(20, seed=11), random_tokens(12, seed=12)
    runner = PagedRunner(ours, num_slots=1)
    runner.step({"first": first})
    runner.slots["second"] = runner.slots.pop("first")
    assert_close(runner.step({"second": second})["second"], hf_logits(hf, second))
