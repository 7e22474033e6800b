"""Data-parallel attention, on rank 0: one scheduler (and block manager) per attention rank,
and each step's plan per rank.

Each request is placed on the rank where it adds the least work, counting the prefix that
rank has cached, and stays there (its KV cache lives there). A step is every rank's step at
once: its chunks are the ranks' in rank order, which is also the order of the logits rows
rank 0 gathers, so sampling and commits read the whole step as one. The ranks step together
because their MoE layers exchange tokens: a rank with nothing to run joins with one dummy
token (eagerly), or with padding rows only when every rank replays a decode graph, the same
bucket on every rank.
"""

from __future__ import annotations

from pegainfer.core.engine.request import Request
from pegainfer.core.engine.scheduler import Scheduler, SchedulerCounters, SchedulerStep
from pegainfer.core.engine.step_plan import StepPlan
from pegainfer.core.runner.cuda_graphs import DecodeGraphs
from pegainfer.core.runner.forward_batch import DataParallelCounts


class DataParallelScheduler:
    """The attention ranks' schedulers behind one scheduler's interface."""

    def __init__(self, ranks: list[Scheduler]) -> None:
        self.ranks = ranks
        self._placed: dict[str, int] = {}  # request id -> its rank

    @property
    def running(self) -> list[Request]:
        return [request for rank in self.ranks for request in rank.running]

    @property
    def waiting(self) -> list[Request]:
        return [request for rank in self.ranks for request in rank.waiting]

    @property
    def has_work(self) -> bool:
        return any(rank.has_work for rank in self.ranks)

    @property
    def kv_usage(self) -> float:
        """The fullest rank's KV usage: the first to preempt."""
        return max(rank.kv_usage for rank in self.ranks)

    @property
    def counters(self) -> SchedulerCounters:
        """The ranks' counters summed, as of now (a snapshot, not a live object)."""
        total = SchedulerCounters()
        for rank in self.ranks:
            for name, value in vars(rank.counters).items():
                setattr(total, name, getattr(total, name) + value)
        return total

    def add(self, request: Request) -> None:
        """Place the request where it adds the least work: the rank's tokens in flight, plus
        the request's tokens less the prefix that rank has cached (the lowest of a tie). A
        shared prefix draws requests to the rank that holds it until that rank's excess load
        outweighs the prefix; then another rank takes one, and caches the prefix too."""
        blocks = self.ranks[0].blocks  # every rank hashes blocks alike
        blocks.extend_block_hashes(request.token_ids, request.block_hashes, request.cache_salt)
        reusable = (request.num_tokens - 1) // blocks.block_size

        def added_work(rank: Scheduler) -> int:
            load = sum(r.num_tokens for queue in (rank.running, rank.waiting) for r in queue)
            cached = len(rank.blocks.match_prefix(request.block_hashes, reusable))
            return load + request.num_tokens - cached * blocks.block_size

        costs = [added_work(rank) for rank in self.ranks]
        rank = costs.index(min(costs))
        self._placed[request.request_id] = rank
        self.ranks[rank].add(request)

    def abort(self, request_id: str) -> Request | None:
        rank = self._placed.pop(request_id, None)
        return None if rank is None else self.ranks[rank].abort(request_id)

    def schedule(self) -> SchedulerStep:
        parts = [rank.schedule() for rank in self.ranks]
        return SchedulerStep(
            chunks=[chunk for part in parts for chunk in part.chunks],
            preempted=[request for part in parts for request in part.preempted],
            parts=parts,
        )

    def advance(self, step: SchedulerStep) -> None:
        for rank, part in zip(self.ranks, step.parts, strict=True):
            rank.advance(part)

    def commit(self, step: SchedulerStep, sampled: list[int]) -> list[Request]:
        """Each rank commits its own sampled ids (the step's are in rank order)."""
        touched: list[Request] = []
        start = 0
        for rank, part in zip(self.ranks, step.parts, strict=True):
            end = start + sum(chunk.samples for chunk in part.chunks)
            touched += rank.commit(part, sampled[start:end])
            start = end
        for request in touched:
            if request.finished:
                self._placed.pop(request.request_id, None)
        return touched


def rank_plans(
    plans: list[StepPlan], dummy_block: int, graphs: DecodeGraphs | None
) -> list[StepPlan]:
    """Every rank's plan completed for a lockstep step: the ranks' counts, the graph bucket
    when every rank's batch is a pure decode that fits one, and a dummy token (at
    `dummy_block`, sampling nothing) for an idle rank's eager step."""
    tokens = [plan.num_tokens for plan in plans]
    rows = [plan.num_logits_rows for plan in plans]
    bucket = None
    if graphs is not None and 0 < max(tokens) <= graphs.max_batch:
        decodes = all(len(chunk) == 1 for plan in plans for chunk in plan.token_chunks)
        if decodes and rows == tokens:
            bucket = graphs.bucket_for(max(tokens))
    completed = []
    for rank, plan in enumerate(plans):
        if tokens[rank] == 0 and bucket is None:
            plan = StepPlan.idle(dummy_block)
            tokens[rank] = 1
        completed.append(plan)
    counts = DataParallelCounts(tuple(tokens), tuple(rows), bucket)
    return [plan.with_counts(counts) for plan in completed]
