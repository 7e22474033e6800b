"""The device side of one rank: its share of the model, its KV cache and CUDA graphs, and the
forward of each planned step.

The engine drives rank 0's runner; every parallel worker drives its own from rank 0's messages
(`tensor_parallel.py`), so a step is built and run the same way on every rank: the plan becomes
a `ForwardBatch` (inputs copied to the device without waiting for it), async scheduling's fed
ids are written into their rows, and the forward replays a decode graph, replays the piecewise
graphs of a mixed step, or launches eagerly, a choice that depends on the plan alone (the
ranks' collectives must meet).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pegainfer.core.engine.step_plan import StepPlan
from pegainfer.core.kv.kv_cache import KVCache
from pegainfer.core.model import Model
from pegainfer.core.runner.cuda_graphs import DecodeGraphs, first_buckets
from pegainfer.core.runner.forward_batch import Feed, ForwardBatch
from pegainfer.core.runner.mixed_buckets import first_token_buckets
from pegainfer.core.runner.piecewise_graphs import MixedGraphs


@dataclass(frozen=True)
class CacheShape:
    """The cache every rank allocates (rank 0 decides: block ids and state slots mean the same
    thing on every rank)."""

    block_size: int
    num_blocks: int
    num_slots: int


@dataclass(frozen=True)
class GraphSpec:
    """The CUDA graphs every rank captures, in the same order: decode graphs per batch bucket,
    then (with `token_buckets`) piecewise graphs of mixed steps per token bucket."""

    buckets: tuple[int, ...]
    dummy_block: int
    dummy_slot: int | None
    token_buckets: tuple[int, ...] = ()
    #: Capture only `first_buckets` (and `first_token_buckets`) now, the rest when a step or
    #: an idle engine needs them (one process only: parallel ranks' graphs hold collectives
    #: captured in step).
    lazy: bool = False


class ModelRunner:
    def __init__(self, model: Model, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.block_size = 0
        self.kv_cache: KVCache | None = None
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None

    def allocate(self, shape: CacheShape) -> KVCache:
        model = self.model
        self.block_size = shape.block_size
        self.kv_cache = KVCache(model.kv_arenas(shape.block_size), shape.num_blocks, self.device,
                                model.state_arenas(), shape.num_slots)  # fmt: skip
        return self.kv_cache

    def capture(self, spec: GraphSpec) -> None:
        """Capture the decode graphs, then the mixed steps' pieces (after `allocate`)."""
        assert self.kv_cache is not None, "allocate() must run before capture()"
        model, cache, block, size = self.model, self.kv_cache, spec.dummy_block, self.block_size
        self.graphs = DecodeGraphs(
            model, cache, spec.buckets, block, size, self.device, spec.dummy_slot
        )
        self.graphs.capture(first_buckets(spec.buckets) if spec.lazy else None)
        if spec.token_buckets:
            self.mixed_graphs = MixedGraphs(
                model, cache, spec.token_buckets, block, size, self.device
            )
            tokens = spec.token_buckets
            self.mixed_graphs.capture(first_token_buckets(tokens) if spec.lazy else None)

    def capture_pending(self) -> bool:
        """Capture one graph not captured yet, a decode graph before the mixed steps' pieces
        (an idle engine's work); whether there was one."""
        for graphs in (self.graphs, self.mixed_graphs):
            if graphs is not None and graphs.pending:
                graphs.capture_next()
                return True
        return False

    def release_graphs(self) -> None:
        """Drop the graphs (they hold captured collectives: they go before the communicator)."""
        self.graphs = self.mixed_graphs = None

    def batch(
        self, plan: StepPlan, feed: Feed | None = None, fed_ids: torch.Tensor | None = None
    ) -> ForwardBatch:
        """The step's batch on the device; with async scheduling, `feed`'s rows take their
        ids from `fed_ids` (sampled by the step still in flight)."""
        batch = plan.batch(self.block_size, self.device)
        if feed is not None:
            feed.apply(batch, fed_ids)
        return batch

    def forward(self, batch: ForwardBatch, capture: bool = True) -> torch.Tensor:
        """The logits of `batch.logits_indices`' rows (none on ranks that compute no logits).
        Without `capture`, a step whose graph is still missing pads to a larger decode graph or
        runs eagerly instead of capturing its own (the start's warm-up)."""
        graphs, mixed = self.graphs, self.mixed_graphs
        if graphs is not None and graphs.can_run(batch):
            if capture:
                graphs.capture_missing(batch)
            return graphs.run(batch)
        if mixed is not None and mixed.can_run(batch):
            if capture:
                mixed.capture_missing(batch)
            if mixed.has_graph_for(batch.num_tokens):
                return mixed.run(batch)
        self.model.prepare(batch)
        return self.model(batch, self.kv_cache)
