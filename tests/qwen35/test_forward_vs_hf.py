"""Our Qwen3.5 forward (paged KV + state slots) equals transformers' logits (float32, ≤ 1e-4)."""

from __future__ import annotations

import pytest

from tests.paged_runner import (
    ForwardMatchesTransformers,
    PagedRunner,
    assert_close,
    hf_logits,
    random_tokens,
)
from tests.qwen35.hf_reference import VOCAB, load_hf, load_ours, write_hf_checkpoint


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def models(request, tmp_path_factory):
    path = write_hf_checkpoint(tmp_path_factory.mktemp("qwen35"), tie=request.param)
    return load_ours(path), load_hf(path)


class TestQwen35Forward(ForwardMatchesTransformers):
    VOCAB = VOCAB
    # 70 and 150 tokens span several 64-token DeltaNet chunks; the chunked prompt continues
    # from the state each chunk saved, and in a mixed batch each sequence has its own slot.
    PREFILL_LENGTHS = (1, 5, 17, 70, 150)
    CHUNKED_LENGTH, CHUNK_SIZES = 100, (7, 66, 1, 26)


def test_a_reused_slot_starts_from_a_clean_state(models):
    """A sequence that starts in a slot another sequence used gets nothing of its state."""
    ours, hf = models
    first, second = random_tokens(20, 11, VOCAB), random_tokens(12, 12, VOCAB)
    runner = PagedRunner(ours, num_slots=1)
    runner.step({"first": first})
    runner.slots["second"] = runner.slots.pop("first")
    assert_close(runner.step({"second": second})["second"], hf_logits(hf, second))
