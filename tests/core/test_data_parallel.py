"""Data-parallel attention's scheduling on rank 0, with no model: requests stay on the rank
they were placed on, a step is every rank's step in rank order, sampled ids go back to the
rank that scheduled them, and each step's per-rank plans agree on counts and graph buckets."""

from __future__ import annotations

import torch

from pegainfer.core.distributed.data_parallel import DataParallelScheduler, rank_plans
from pegainfer.core.engine.scheduler import Scheduler, SchedulerConfig
from pegainfer.core.engine.step_plan import StepPlan
from pegainfer.core.kv.block_manager import BlockManager
from pegainfer.core.runner.forward_batch import DataParallelCounts
from tests.core.test_scheduler import BS, request


def make(ranks: int = 2, budget: int = 16) -> DataParallelScheduler:
    config = SchedulerConfig(8, budget, max_model_len=1024)
    return DataParallelScheduler(
        [Scheduler(config, BlockManager(64, BS, True)) for _ in range(ranks)]
    )


def placed(s: DataParallelScheduler) -> list[list[str]]:
    return [[r.request_id for r in rank.running + list(rank.waiting)] for rank in s.ranks]


def output(r) -> list[int]:
    return r.token_ids[r.num_prompt_tokens :]


def test_requests_go_to_the_least_loaded_rank_and_stay_there():
    s = make()
    for rid in "abc":
        s.add(request(rid, 5))
    assert placed(s) == [["a", "c"], ["b"]]
    assert s.abort("a") is not None and s.abort("a") is None
    s.add(request("d", 5))
    assert placed(s) == [["c", "d"], ["b"]]  # a tie: the lower rank
    assert s.kv_usage == 0.0 and len(s.waiting) == 3


def test_a_step_is_every_ranks_step_and_each_rank_commits_its_own_ids():
    s = make(budget=6)
    s.add(request("a", 9, max_tokens=2))  # rank 0: chunked over two steps
    s.add(request("b", 3, max_tokens=2))  # rank 1
    step = s.schedule()
    assert [[c.request.request_id for c in part.chunks] for part in step.parts] == [["a"], ["b"]]
    assert [c.num_tokens for c in step.chunks] == [6, 3]
    s.advance(step)
    touched = s.commit(step, [41])  # only b sampled
    assert [r.request_id for r in touched] == ["b"] and output(touched[0]) == [41]
    step = s.schedule()
    assert [c.num_tokens for c in step.chunks] == [3, 1]
    s.advance(step)
    touched = s.commit(step, [50, 42])
    assert {r.request_id: output(r) for r in touched} == {"a": [50], "b": [41, 42]}
    assert touched[1].finished and placed(s) == [["a"], []]
    assert s.counters.prefix_queries == 12


class _Graphs:
    max_batch = 8

    @staticmethod
    def bucket_for(n: int) -> int:
        return 4 if n <= 4 else 8


def plan(chunks: list[list[int]], sample: bool = True) -> StepPlan:
    return StepPlan(token_chunks=chunks, start_positions=[4] * len(chunks),
                    block_tables=[[1, 2]] * len(chunks), sample_mask=[sample] * len(chunks),
                    every_row=[False] * len(chunks), state_slots=list(range(len(chunks))),
                    state_restore=[None] * len(chunks),
                    state_snapshot=[None] * len(chunks))  # fmt: skip


def test_an_idle_rank_runs_a_dummy_token_eagerly_and_only_padding_under_a_graph():
    decode = plan([[3], [5], [7]])
    eager = rank_plans([plan([[1, 2, 3]]), plan([])], dummy_block=99, graphs=_Graphs())
    assert eager[1].token_chunks == [[0]] and eager[1].block_tables == [[99]]
    assert eager[0].data_parallel == DataParallelCounts((3, 1), (1, 0), None)
    batch = eager[1].batch(BS, torch.device("cpu"))
    assert batch.num_tokens == 1 and batch.logits_indices.numel() == 0
    graphed = rank_plans([decode, plan([])], dummy_block=99, graphs=_Graphs())
    assert graphed[1].token_chunks == []
    assert graphed[1].data_parallel == DataParallelCounts((3, 0), (3, 0), 4)
    assert rank_plans([decode, plan([[1]] * 6)], 99, _Graphs())[0].data_parallel.bucket == 8
    assert rank_plans([decode, plan([[1]] * 9)], 99, _Graphs())[0].data_parallel.bucket is None
    assert rank_plans([decode, plan([[1]] * 2)], 99, None)[0].data_parallel.bucket is None
    not_sampling = rank_plans([decode, plan([[1]], sample=False)], 99, _Graphs())
    assert not_sampling[0].data_parallel == DataParallelCounts((3, 1), (3, 0), None)


def test_a_cached_prefix_draws_a_request_until_its_ranks_extra_load_outweighs_it():
    s = make(budget=64)
    s.add(request("a", 20, max_tokens=50))  # rank 0
    s.add(request("b", 20, max_tokens=50, first=100))  # rank 1: caches 5 blocks of 4
    for _ in range(2):
        step = s.schedule()
        s.advance(step)
        s.commit(step, [7] * sum(c.samples for c in step.chunks))
    assert [len(rank.running) for rank in s.ranks] == [1, 1]
    # Same load (21 tokens each): b's prefix (16 reusable tokens of 24) wins.
    s.add(request("c", 24, first=100))
    assert placed(s) == [["a"], ["b", "c"]]
    # Rank 1 now holds 24 more tokens than rank 0: more than the 16 its cache saves.
    s.add(request("d", 24, first=100))
    assert placed(s) == [["a", "d"], ["b", "c"]]
