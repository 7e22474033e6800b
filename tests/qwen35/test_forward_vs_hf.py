"""Our Qwen3.5 forward (paged KV + state slots) equals transformers' logits (float32, ≤ 1e-4)."""

from __future__ import annotations

import pytest

from tests.paged_runner import (
    PagedRunner,
    assert_close,
    check_chunked_prefill,
    check_mixed_batch,
    check_token_by_token_decode,
    hf_logits,
    random_tokens,
)
from tests.qwen35.hf_reference import VOCAB, load_hf, load_ours, write_hf_checkpoint


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def models(request, tmp_path_factory):
    path = write_hf_checkpoint(tmp_path_factory.mktemp("qwen35"), tie=request.param)
    return load_ours(path), load_hf(path)


@pytest.mark.parametrize("length", [1, 5, 17, 70, 150])
def test_prefill(models, length):
    """One chunk; 70 and 150 tokens span several 64-token DeltaNet chunks."""
    ours, hf = models
    tokens = random_tokens(length, length, VOCAB)
    assert_close(PagedRunner(ours).step({"a": tokens})["a"], hf_logits(hf, tokens))


def test_chunked_prefill_continues_from_saved_state(models):
    check_chunked_prefill(*models, random_tokens(100, 7, VOCAB), (7, 66, 1, 26))


def test_token_by_token_decode(models):
    check_token_by_token_decode(*models, random_tokens(24, 3, VOCAB), prefill=10)


def test_mixed_batch(models):
    """Each sequence in its own state slot."""
    check_mixed_batch(*models, VOCAB)


def test_a_reused_slot_starts_from_a_clean_state(models):
    """A sequence that starts in a slot another sequence used gets nothing of its state."""
    ours, hf = models
    first, second = random_tokens(20, 11, VOCAB), random_tokens(12, 12, VOCAB)
    runner = PagedRunner(ours, num_slots=1)
    runner.step({"first": first})
    runner.slots["second"] = runner.slots.pop("first")
    assert_close(runner.step({"second": second})["second"], hf_logits(hf, second))
