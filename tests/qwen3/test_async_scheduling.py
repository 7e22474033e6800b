"""Async scheduling (step N+1 launched before step N's tokens reach the host) produces what the
step-by-step engine produces, through stops, min_tokens, seeds, length limits and aborts."""

from __future__ import annotations

import torch

from pegainfer.core.engine.messages import EngineRequest
from pegainfer.core.sampling.sampling_params import SamplingParams
from tests.engine_harness import drain, make_engine
from tests.qwen3.hf_reference import VOCAB


def workload(stop_token: int) -> list[tuple[str, list[int], SamplingParams, list[int]]]:
    g = torch.Generator().manual_seed(5)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    return [
        ("greedy", prompt(9), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), []),
        ("stops", prompt(20), SamplingParams(temperature=0.0, max_tokens=30), [stop_token]),
        ("min", prompt(7), SamplingParams(temperature=0.0, max_tokens=30, min_tokens=6),
         [stop_token]),
        ("seeded", prompt(15), SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=10,
                                              ignore_eos=True), []),
        ("aborted", prompt(11), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
         []),
        ("long", prompt(33), SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True), []),
    ]  # fmt: skip


def run(path, async_scheduling: bool, stop_token: int) -> dict[str, tuple[list[int], str | None]]:
    engine = make_engine(path, async_scheduling=async_scheduling, max_num_batched_tokens=24)
    for rid, prompt, params, eos in workload(stop_token):
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt, params=params,
                                         eos_token_ids=eos, arrival_time=0.0))  # fmt: skip
    results: dict[str, tuple[list[int], str | None]] = {}
    aborted = False
    while engine.has_unfinished_requests:
        if not aborted and len(results.get("aborted", ([], None))[0]) >= 3:
            # With async scheduling its next token is already being sampled: it is dropped.
            engine.abort(["aborted"])
            aborted = True
        for output in engine.step():
            tokens, _ = results.get(output.request_id, ([], None))
            results[output.request_id] = (tokens + output.new_token_ids, output.finish_reason)
    engine.block_manager.check_invariants()
    assert engine.block_manager.usage == 0.0 and not engine.scheduler.running
    return results


def test_async_scheduling_changes_no_output(hf_checkpoints):
    path = hf_checkpoints(False)
    # A token the greedy request emits a few tokens in: "stops" and "min" may meet it early.
    probe = run(path, False, stop_token=-1)
    stop_token = probe["stops"][0][3]
    sync = run(path, False, stop_token)
    assert sync["stops"][1] == "stop" and len(sync["stops"][0]) <= 4
    assert len(sync["min"][0]) >= 6
    assert len(sync["aborted"][0]) == 3 and len(sync["long"][0]) == 25
    assert run(path, True, stop_token) == sync


def test_penalties_under_both_schedulers(hf_checkpoints):
    """A penalised request beside a plain one: the async engine brings the pending token home
    before sampling with penalties, so both schedulers agree; the penalty changes the output."""
    path = hf_checkpoints(False)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (12, 30)]
    penalised = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                               frequency_penalty=1.5, presence_penalty=0.5,
                               repetition_penalty=1.3)  # fmt: skip
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    results = []
    for async_scheduling, first in ((False, penalised), (True, penalised), (False, plain)):
        engine = make_engine(path, async_scheduling=async_scheduling)
        for rid, (prompt, params) in enumerate(zip(prompts, (first, plain), strict=True)):
            engine.add_request(EngineRequest(request_id=str(rid), prompt_token_ids=prompt,
                                             params=params, eos_token_ids=[],
                                             arrival_time=0.0))  # fmt: skip
        results.append(drain(engine))
    assert results[0] == results[1]
    assert results[0]["0"] != results[2]["0"] and results[0]["1"] == results[2]["1"]
