"""Qwen3.5 through the engine (scheduler, blocks, state slots, sampler) against transformers."""

from __future__ import annotations

import pytest
import torch

from tests.engine_harness import drain, generate, greedy, make_engine, submit
from tests.qwen35.hf_reference import VOCAB, load_hf, write_hf_checkpoint

NEW_TOKENS = 16


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Six prompts of different lengths (up to two DeltaNet chunks) and transformers' greedy
    continuations."""
    path = write_hf_checkpoint(tmp_path_factory.mktemp("qwen35-engine"), tie=True, seed=3)
    hf = load_hf(path)
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 4, 13, 30, 70, 130)]
    return path, batch, [hf_greedy(hf, p, NEW_TOKENS) for p in batch]


def test_greedy_batch_equals_transformers(reference):
    path, batch, expected = reference
    assert generate(make_engine(path), batch, greedy(NEW_TOKENS)) == expected


def test_chunked_prefill_beside_decodes_and_slots_reused(reference):
    """Prompts cut into 16-token chunks that share steps with decodes; two sequences at a time,
    so later requests take slots that finished ones left."""
    path, batch, expected = reference
    engine = make_engine(path, max_num_batched_tokens=16, max_num_seqs=2)
    assert generate(engine, batch, greedy(NEW_TOKENS)) == expected


def test_preemption_recomputes_state_from_scratch(reference):
    path, batch, expected = reference
    engine = make_engine(path, num_kv_blocks=60, max_model_len=160)
    for i, prompt in enumerate(batch * 2):
        submit(engine, str(i), prompt, greedy(NEW_TOKENS))
    preempted = 0
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests:
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
        preempted = max(preempted, sum(r.num_preemptions for r in engine.requests.values()))
    assert preempted > 0, "the pool was large enough that nothing was preempted"
    assert [outputs[str(i)] for i in range(2 * len(batch))] == expected * 2


def test_prefix_caching_is_off_for_the_hybrid_model(reference):
    """Until DeltaNet states are checkpointed, a repeated prompt is computed again in full."""
    path, batch, expected = reference
    engine = make_engine(path)
    assert not engine.block_manager.enable_prefix_caching
    for attempt in range(2):
        submit(engine, str(attempt), batch[-1], greedy(NEW_TOKENS))
        assert drain(engine)[str(attempt)] == expected[-1]
    assert engine.scheduler.counters.prefix_hits == 0
