"""Qwen3.5 through the engine (scheduler, blocks, state slots, sampler) against transformers."""

from __future__ import annotations

import pytest
import torch

from tests.engine_harness import (
    both_schedulers,  # noqa: F401 (a fixture)
    drain,
    generate,
    greedy,
    hf_greedy,
    make_engine,
    submit,
)
from tests.qwen35.hf_reference import VOCAB, load_hf, write_hf_checkpoint

pytestmark = pytest.mark.usefixtures("both_schedulers")

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Six prompts of different lengths (up to two DeltaNet chunks) and transformers' greedy
    continuations."""
    path = write_hf_checkpoint(tmp_path_factory.mktemp("qwen35-engine"), tie=True, seed=3)
    hf = load_hf(path)
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 4, 13, 30, 70, 130)]
    return path, batch, [hf_greedy(hf, p, NEW_TOKENS) for p in batch], hf


def test_greedy_batch_equals_transformers(reference):
    path, batch, expected, _ = reference
    assert generate(make_engine(path), batch, greedy(NEW_TOKENS)) == expected


def test_chunked_prefill_beside_decodes_and_slots_reused(reference):
    """Prompts cut into 16-token chunks that share steps with decodes; two sequences at a time,
    so later requests take slots that finished ones left."""
    path, batch, expected, _ = reference
    engine = make_engine(path, max_num_batched_tokens=16, max_num_seqs=2)
    assert generate(engine, batch, greedy(NEW_TOKENS)) == expected


def test_preemption_recomputes_state_from_scratch(reference):
    path, batch, expected, _ = reference
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


@pytest.mark.parametrize("budget", [2048, 16], ids=["one-step-prefill", "chunked-prefill"])
@pytest.mark.parametrize("first", [4, 5])  # which prompt opens the conversation: 70 or 130
def test_next_turn_restores_the_checkpointed_state(reference, budget, first):
    """A chat's next turn (the first turn's prompt and answer, then new text) reuses the KV up
    to the first prompt's last full block and the DeltaNet state checkpointed there, and
    generates what transformers generates from scratch. With 16-token chunks the checkpoint
    falls inside a chunk for the 70-token prompt."""
    path, batch, expected, hf = reference
    engine = make_engine(path, max_num_batched_tokens=budget)
    prompt = batch[first]
    submit(engine, "turn1", prompt, greedy(NEW_TOKENS))
    assert drain(engine)["turn1"] == expected[first]
    turn2 = [*prompt, *expected[first], *batch[2]]
    submit(engine, "turn2", turn2, greedy(NEW_TOKENS))
    engine.step()
    boundary = (len(prompt) - 1) // 4 * 4
    assert engine.requests["turn2"].num_cached_tokens == boundary
    assert drain(engine)["turn2"][-NEW_TOKENS + 1 :] == hf_greedy(hf, turn2, NEW_TOKENS)[1:]


def test_checkpoints_are_bounded_and_evicted_safely(reference):
    """One checkpoint for several prompts: each new prompt evicts the last one's, and every
    output stays right (a hit restores only a state that exists)."""
    path, batch, expected, _ = reference
    engine = make_engine(path, state_checkpoints=1)
    for round_ in range(2):
        for i in (3, 4, 5):
            submit(engine, f"{round_}-{i}", batch[i], greedy(NEW_TOKENS))
            assert drain(engine)[f"{round_}-{i}"] == expected[i]
    assert len(engine.scheduler.checkpoints) == 1
    submit(engine, "again", batch[5], greedy(NEW_TOKENS))
    engine.step()
    assert engine.requests["again"].num_cached_tokens == (len(batch[5]) - 1) // 4 * 4
    assert drain(engine)["again"][-NEW_TOKENS + 1 :] == expected[5][1:]


def test_no_checkpoints_means_no_prefix_caching(reference):
    path, batch, expected, _ = reference
    engine = make_engine(path, state_checkpoints=0)
    assert not engine.block_manager.enable_prefix_caching
    for attempt in range(2):
        submit(engine, str(attempt), batch[-1], greedy(NEW_TOKENS))
        assert drain(engine)[str(attempt)] == expected[-1]
    assert engine.scheduler.counters.prefix_hits == 0


def test_abort_mid_generation_frees_the_slot_for_the_next_request(reference):
    """Two sequences at a time: aborting one mid-generation hands its slot and blocks to the
    waiting request, which starts from a clean state; the others are unchanged."""
    path, batch, expected, _ = reference
    engine = make_engine(path, max_num_seqs=2)
    for i in (2, 3, 4):
        submit(engine, str(i), batch[i], greedy(NEW_TOKENS))
    outputs: dict[str, list[int]] = {}
    aborted = False
    while engine.has_unfinished_requests:
        if not aborted and len(outputs.get("2", [])) >= 3:
            engine.abort(["2"])
            aborted = True
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert outputs["2"] == expected[2][:3]
    assert outputs["3"] == expected[3] and outputs["4"] == expected[4]
    assert engine.block_manager.usage == 0.0 and not engine.scheduler.running
