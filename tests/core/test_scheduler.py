"""The default scheduler with no model: budgets, chunking, admission, preemption, abort."""

from __future__ import annotations

from pegainfer.core.engine.messages import EngineRequest
from pegainfer.core.engine.request import Request, RequestStatus
from pegainfer.core.engine.scheduler import Scheduler, SchedulerConfig, SchedulerStep
from pegainfer.core.kv.block_manager import BlockManager
from pegainfer.core.sampling.sampling_params import SamplingParams

BS = 4


def make(num_blocks=64, max_seqs=8, budget=32, chunked=True, caching=True) -> Scheduler:
    config = SchedulerConfig(max_seqs, budget, max_model_len=1024, enable_chunked_prefill=chunked)
    return Scheduler(config, BlockManager(num_blocks, BS, caching))


def request(rid: str, prompt_len: int, max_tokens: int = 100, first: int = 0) -> Request:
    msg = EngineRequest(
        request_id=rid,
        prompt_token_ids=list(range(first, first + prompt_len)),
        params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        eos_token_ids=[],
        arrival_time=0.0,
    )
    return Request(msg, max_tokens, None)


def run_step(s: Scheduler, token: int = 7) -> SchedulerStep:
    """Schedule, then pretend the model sampled `token` for every row that samples."""
    step = s.schedule()
    s.update(step, [token] * sum(c.samples for c in step.chunks))
    return step


def sizes(step: SchedulerStep) -> dict[str, int]:
    return {c.request.request_id: c.num_tokens for c in step.chunks}


def test_token_budget_chunks_long_prompts_alongside_decodes():
    s = make(budget=16)
    s.add(request("a", 5))
    assert sizes(run_step(s)) == {"a": 5}
    s.add(request("b", 40, first=100))
    step = run_step(s)
    assert sizes(step) == {"a": 1, "b": 15}
    assert [c.samples for c in step.chunks] == [True, False]
    assert sizes(run_step(s)) == {"a": 1, "b": 15}
    step = run_step(s)
    assert sizes(step) == {"a": 1, "b": 10} and step.chunks[1].samples


def test_without_chunking_a_long_prompt_waits_for_a_step_of_its_own():
    s = make(budget=16, chunked=False)
    s.add(request("long", 20))
    assert run_step(s).chunks == []
    s = make(budget=16, chunked=False)
    s.add(request("a", 3))
    s.add(request("b", 14))
    assert sizes(run_step(s)) == {"a": 3}


def test_max_num_seqs_caps_the_running_set():
    s = make(max_seqs=2)
    for i in range(4):
        s.add(request(str(i), 3, first=10 * i))
    assert sizes(run_step(s)) == {"0": 3, "1": 3}
    assert len(s.waiting) == 2


def test_preemption_takes_the_newest_and_it_recomputes_with_its_outputs():
    s = make(num_blocks=6, budget=64)
    s.add(request("old", 8, first=0))
    s.add(request("new", 8, first=100))
    run_step(s)  # both prefilled: 2 blocks each, 2 blocks left
    for _ in range(4):
        run_step(s)  # each needs a third block after 4 decodes, then a 4th
    step = run_step(s)
    preempted = [r.request_id for r in step.preempted]
    assert preempted == ["new"]
    new = s.waiting[0]
    assert new.status is RequestStatus.PREEMPTED and new.block_ids == []
    assert new.num_output_tokens == 5  # its outputs are kept and recomputed as prompt
    s.blocks.check_invariants()


def test_abort_frees_blocks_wherever_the_request_is():
    s = make()
    s.add(request("run", 9))
    run_step(s)
    s.add(request("wait", 3))
    used = s.blocks.num_free_blocks
    assert s.abort("run") is not None and s.abort("wait") is not None
    assert s.abort("unknown") is None
    assert s.blocks.num_free_blocks > used and s.blocks.usage == 0.0
    assert not s.has_work


def test_finished_requests_release_and_seal_their_blocks():
    s = make()
    s.add(request("a", 8, max_tokens=2))
    run_step(s)
    run_step(s)
    assert not s.has_work and s.blocks.usage == 0.0
    s.add(request("b", 9))
    run_step(s)
    assert s.running[0].num_cached_tokens == 8  # both full prompt blocks were reused


def test_every_running_request_holds_its_own_state_slot_until_it_leaves():
    s = make(max_seqs=3, budget=64)
    s.add(request("old", 8, max_tokens=3, first=0))
    s.add(request("new", 8, first=100))
    s.add(request("aborted", 2, first=200))
    s.add(request("fourth", 2, first=300))
    run_step(s)  # three admitted (max_num_seqs), the fourth waits
    slots = {r.request_id: r.slot for r in s.running}
    assert sorted(slots.values()) == [0, 1, 2] and s.waiting[0].slot is None
    assert s.abort("aborted") is not None  # a running request's slot goes back on abort
    run_step(s)  # the fourth takes the freed slot
    assert {r.request_id: r.slot for r in s.running}["fourth"] == slots["aborted"]
    while any(r.request_id == "old" for r in s.running):
        run_step(s)  # "old" finishes after 3 tokens and frees its slot
    held = [r.slot for r in s.running]
    assert len(set(held)) == len(held) == 2 and slots["old"] not in held


def test_a_preempted_request_gives_its_slot_back():
    s = make(num_blocks=6, budget=64)
    s.add(request("old", 8, first=0))
    s.add(request("new", 8, first=100))
    for _ in range(6):
        step = run_step(s)
        if step.preempted:
            break
    assert [r.request_id for r in step.preempted] == ["new"] and step.preempted[0].slot is None
    assert [r.slot for r in s.running] == [0]
    s.blocks.check_invariants()


def test_one_token_chunks_come_first_in_their_order():
    """Attention runs a step's leading one-token rows apart from the prefill rows: a one-token
    chunk (here a one-token prompt) moves ahead of the prefill chunks; the rest keep their
    order."""
    s = make(budget=32)
    s.add(request("long", 40))
    assert sizes(run_step(s)) == {"long": 32}
    s.add(request("p", 1, first=100))
    s.add(request("b", 2, first=200))
    step = run_step(s)
    assert [(c.request.request_id, c.num_tokens) for c in step.chunks] == [
        ("p", 1), ("long", 8), ("b", 2)
    ]  # fmt: skip
    step = run_step(s)
    assert [(c.request.request_id, c.num_tokens) for c in step.chunks] == [
        ("long", 1), ("p", 1), ("b", 1)
    ]  # fmt: skip
