"""End to end through the engine (scheduler, blocks, sampler) against transformers' generate."""

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
from tests.qwen3.hf_reference import VOCAB, load_hf

pytestmark = pytest.mark.usefixtures("both_schedulers")

NEW_TOKENS = 32


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(hf_checkpoints):
    """Eight prompts of different lengths and transformers' greedy continuations."""
    path = hf_checkpoints(False)
    hf = load_hf(path)
    batch = prompts([1, 3, 8, 13, 21, 34, 55, 90])
    return path, batch, [hf_greedy(hf, p, NEW_TOKENS) for p in batch]


def test_greedy_batch_equals_transformers(reference):
    path, batch, expected = reference
    assert generate(make_engine(path), batch, greedy(NEW_TOKENS)) == expected


def test_chunked_prefill_in_the_same_steps_as_decodes(reference):
    path, batch, expected = reference
    engine = make_engine(path, max_num_batched_tokens=16)
    assert generate(engine, batch, greedy(NEW_TOKENS)) == expected


def test_preemption_with_few_blocks(reference):
    """32 requests on a pool that holds a few sequences: all finish, outputs unchanged."""
    path, batch, expected = reference
    many = batch * 4
    engine = make_engine(path, num_kv_blocks=128, max_model_len=128)
    for i, prompt in enumerate(many):
        submit(engine, str(i), prompt, greedy(NEW_TOKENS))
    preempted = 0
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests:
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
        preempted = max(preempted, sum(r.num_preemptions for r in engine.requests.values()))
    assert preempted > 0, "the pool was large enough that nothing was preempted"
    assert [outputs[str(i)] for i in range(len(many))] == expected * 4
    assert engine.block_manager.usage == 0.0


def test_prefix_cache_reuses_blocks_and_keeps_outputs(reference):
    path, batch, _ = reference
    shared = batch[-1][:64]
    first, second = [*shared, 1, 2, 3], [*shared, 4, 5]
    outputs = {}
    for caching in (True, False):
        engine = make_engine(path, enable_prefix_caching=caching)
        submit(engine, "first", first, greedy(8))
        drain(engine)
        submit(engine, "second", second, greedy(8))
        engine.step()
        cached = engine.requests["second"].num_cached_tokens
        outputs[caching] = drain(engine)
        assert cached == (64 if caching else 0)
        assert engine.scheduler.counters.prefix_hits == (64 if caching else 0)
        assert engine.scheduler.counters.prefix_queries == len(first) + len(second)
    assert outputs[True] == outputs[False]


def test_eviction_under_a_small_pool_keeps_outputs_right(reference):
    """Cached blocks are evicted to make room; a repeated prompt still hits and stays right."""
    path, batch, expected = reference
    engine = make_engine(path, num_kv_blocks=40, max_model_len=128)
    for round_ in range(2):
        for i, prompt in enumerate(batch):
            for attempt in range(2):
                rid = f"{round_}-{i}-{attempt}"
                submit(engine, rid, prompt, greedy(NEW_TOKENS))
                first = [t for out in engine.step() for t in out.new_token_ids]
                cached = engine.requests[rid].num_cached_tokens
                assert first + drain(engine).get(rid, []) == expected[i]
                if attempt == 1 and len(prompt) > 4:
                    assert cached == (len(prompt) - 1) // 4 * 4
    # Far more blocks were filled than the pool holds, so eviction happened throughout.
    assert 2 * 2 * sum(len(p) + NEW_TOKENS for p in batch) // 4 > 3 * 40


def test_logprobs_are_transformers_log_softmax(reference):
    """Each sampled token's logprob, rank and top 5 equal transformers' log-softmax at its
    position (sampled at temperature 1, with a bias and a penalty that must not change the
    reported distribution), batched with requests that ask for none."""
    from pegainfer.core.sampling.sampling_params import SamplingParams

    path, batch, _ = reference
    engine = make_engine(path)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=5,
                            logit_bias={7: 5.0}, presence_penalty=0.5)  # fmt: skip
    outputs = {}
    for i, prompt in enumerate(batch[:4]):
        submit(engine, f"lp{i}", prompt, params)
        submit(engine, f"plain{i}", prompt, greedy(12))
    while engine.has_unfinished_requests:
        for output in engine.step():
            if output.logprobs is not None:
                outputs.setdefault(output.request_id, []).extend(output.logprobs)
            else:
                assert not output.request_id.startswith("lp") or not output.new_token_ids
    assert sorted(outputs) == [f"lp{i}" for i in range(4)]
    hf = load_hf(path)
    for i, prompt in enumerate(batch[:4]):
        entries = outputs[f"lp{i}"]
        tokens = [e.token_id for e in entries]
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        ref = logits.float().log_softmax(-1)
        for row, entry in zip(ref, entries, strict=True):
            assert abs(entry.logprob - row[entry.token_id].item()) <= 1e-4
            assert entry.rank == int((row > row[entry.token_id]).sum()) + 1
            top = row.topk(5)
            assert [t for t, _ in entry.top] == top.indices.tolist()
            assert max(abs(lp - v) for (_, lp), v in zip(entry.top, top.values.tolist(),
                                                         strict=True)) <= 1e-4  # fmt: skip


def test_prompt_logprobs_are_transformers_log_softmax(reference):
    """Every prompt token after the first, scored by the prompt before it, across prefill
    chunks of 16 tokens and although the prompt sits in the prefix cache already."""
    from pegainfer.core.sampling.sampling_params import SamplingParams

    path, batch, _ = reference
    engine = make_engine(path, max_num_batched_tokens=16, enable_chunked_prefill=True)
    prompt = batch[-1]  # 90 tokens
    submit(engine, "warm", prompt, greedy(2))
    drain(engine)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    submit(engine, "scored", prompt, params)
    first = None
    while engine.has_unfinished_requests:
        for output in engine.step():
            if output.new_token_ids and first is None:
                first = output
            else:
                assert output.prompt_logprobs is None  # sent once, with the first token
    entries = first.prompt_logprobs
    assert [e.token_id for e in entries] == prompt[1:]
    with torch.inference_mode():
        ref = load_hf(path)(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    for row, entry in zip(ref, entries, strict=True):
        assert abs(entry.logprob - row[entry.token_id].item()) <= 1e-4
        assert entry.rank == int((row > row[entry.token_id]).sum()) + 1
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()


def test_copies_of_one_prompt_share_its_prefill(reference):
    """n choices arrive as copies of one prompt: the first computes it, the others wait a step
    and reuse its blocks, and each answers as the prompt alone would."""
    path, batch, expected = reference
    engine = make_engine(path)
    prompt = batch[-1]  # 90 tokens: 22 full blocks of 4 reusable
    for i in range(4):
        submit(engine, f"copy{i}", prompt, greedy(NEW_TOKENS))
    assert drain(engine) == {f"copy{i}": expected[-1] for i in range(4)}
    assert engine.scheduler.counters.prefix_hits == 3 * 22 * 4
