"""CUDA graphs for steps that carry prefill tokens: the forward captured in pieces between its
attention calls, one set of pieces per token-count bucket.

A mixed step (decodes beside a prefill chunk, a short prompt, a prefix hit's last tokens) run
eagerly launches about a thousand kernels from Python. Everything in a layer but attention
depends only on the number of tokens, so it can be captured for a padded token count; the
attention of a mixed batch cannot (its plan depends on every sequence's length). So the model's
hidden-state pass is captured as segments split at each attention call: at replay, segment 0
runs (embedding, the first layer up to its attention), then the attention runs eagerly over the
real rows with the step's own plan, then segment 1 (that layer's output projection and MLP, the
next layer up to its attention), and so on; the final norm and LM head run eagerly on the rows
that want logits. This is vLLM's piecewise CUDA graph, without a graph compiler: a model opts in
(`Model.supports_piecewise_graphs`) by splitting its forward into `hidden_states` and `logits`
and routing every call that depends on the batch's sequences through its cuts
(`Model.piecewise_cuts`: attention backends, whose `split` hook ends a piece while the pieces
are captured and gets the call, its per-token inputs and its other inputs).

Padding rows (token 0 at position 0) write their KV to the reserved dummy block; attention is
planned and run for the real rows only, so the padding rows' attention output is whatever the
buffer held (finite: it starts zeroed and only attention writes it), and every other op is
row-wise, so real rows never see them.

The buckets (`runner/mixed_buckets.py`) stop where steps stop being launch-bound; larger steps
run eagerly. One process may capture only the first buckets before it serves: a step whose own
bucket is missing captures it first (`capture_missing`), and an idle engine captures the others
(`capture_next`), smallest first. Every capture shares one memory pool: one bucket's pieces
replay at a time, and each replay writes every intermediate it reads.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pegainfer.core.kv.kv_cache import KVCache
from pegainfer.core.model import Model
from pegainfer.core.runner.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


def held_bytes_per_token(model: Model, batch: ForwardBatch, kv_cache: KVCache) -> int:
    """Bytes per token that one bucket's pieces keep in their pool between replays, measured
    on an eager hidden-state pass of `batch`: the storage of every cut's per-token inputs (each
    split holds its own, e.g. a layer's queries: the attention between two pieces reads them)
    and of the final states. Memory the pieces free after capture is reused by later captures;
    these stay, bucket after bucket (Qwen3-4B: 36 layers' queries, 288 KiB a token)."""
    held: list[torch.Tensor] = []

    def record(call: Callable[..., torch.Tensor], rows: tuple, fixed: tuple) -> torch.Tensor:
        held.extend(rows)
        return call(*rows, *fixed)

    cuts = model.piecewise_cuts()
    for cut in cuts:
        cut.split = record
    try:
        model.prepare(batch)
        held.extend(model.hidden_states(batch, kv_cache))
    finally:
        for cut in cuts:
            cut.split = None
    # A view holds its whole storage (e.g. one projection's output split in two).
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
    return sum(storages.values()) // batch.num_tokens


@dataclass
class _Split:
    """One call cut out of the captured pieces: its per-token inputs (static tensors the
    piece before writes, sliced to the real rows at replay), its other inputs, and the static
    buffer its output goes to (which the piece after reads)."""

    call: Callable[..., torch.Tensor]
    rows: tuple[torch.Tensor, ...]
    fixed: tuple
    out: torch.Tensor


@dataclass
class _Pieces:
    """One bucket's captured segments (one more than its splits) and their static outputs."""

    graphs: list[torch.cuda.CUDAGraph]
    splits: list[_Split]
    states: tuple[torch.Tensor, ...]


class MixedGraphs:
    """Piecewise graphs of a model's hidden-state pass, one set per token bucket."""

    def __init__(
        self,
        model: Model,
        kv_cache: KVCache,
        buckets: tuple[int, ...],
        dummy_block: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.buckets = buckets
        self.dummy_block = dummy_block
        self.block_size = block_size
        self.device = device
        self.cuts = model.piecewise_cuts()
        largest = max(buckets)
        # Static inputs: [input_ids, positions, slot_mapping] per row; padding rows keep these.
        self._pad = torch.tensor([0, 0, dummy_block * block_size], device=device)
        self._inputs = self._pad[:, None].repeat(1, largest).contiguous()
        # One output buffer per output shape, shared by every cut of every bucket (the pieces
        # run in order), sized for the largest bucket.
        self._outputs: dict[tuple, torch.Tensor] = {}
        self._pieces: dict[int, _Pieces] = {}
        self._pool: object | None = None  # the pieces' memory pool, once one is captured

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._pieces))

    @property
    def pending(self) -> list[int]:
        """The buckets not captured yet, smallest first."""
        return [b for b in self.buckets if b not in self._pieces]

    def bucket_for(self, num_tokens: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

    def has_graph_for(self, num_tokens: int) -> bool:
        """Whether the bucket of a step of `num_tokens` (within the largest) is captured."""
        return self.bucket_for(num_tokens) in self._pieces

    def can_run(self, batch: ForwardBatch) -> bool:
        """Any single-process step within the largest bucket, unless the model has recurrent
        state and some sequence's state starts this step (those restart eagerly). The engine
        gives every sequence a slot, so a prompt's first chunk "starts" one even for a model
        without state: only the cache says whether that matters."""
        restarts = self.kv_cache.num_slots > 0 and batch.starts_states
        return batch.data_parallel is None and batch.num_tokens <= self.max_tokens and not restarts

    def capture(self, buckets: tuple[int, ...] | None = None) -> None:
        """Capture `buckets` (default: every one), largest first."""
        for bucket in sorted(buckets or self.buckets, reverse=True):
            self._capture_bucket(bucket)
        segments = sum(len(p.graphs) for p in self._pieces.values())
        logger.info("captured piecewise CUDA graphs for mixed steps of %s tokens (%d segments)%s",
                    self.captured, segments,
                    f" ({len(self.pending)} more later)" if self.pending else "")  # fmt: skip

    def capture_next(self) -> None:
        """Capture the smallest bucket not captured yet (an idle engine's work)."""
        self._capture_bucket(self.pending[0])
        if not self.pending:
            logger.info("captured every mixed-step graph (%d token buckets)", len(self.buckets))

    def capture_missing(self, batch: ForwardBatch) -> None:
        """Capture the bucket of `batch`'s token count, if it is still missing."""
        bucket = self.bucket_for(batch.num_tokens)
        if bucket not in self._pieces:
            self._capture_bucket(bucket)

    def _capture_bucket(self, bucket: int) -> None:
        # Padding rows only (a replay leaves real rows' ids, positions and slots behind): the
        # warm-up and the capture write the dummy block alone.
        self._inputs[:, :bucket].copy_(self._pad[:, None].expand(-1, bucket))
        batch = self._static_batch(bucket)
        # Warm-up, eagerly: compiles kernels for this size, settles allocations. The hidden
        # states only, as the pieces hold them (logits of every row would be bucket x vocab).
        self.model.prepare(batch)
        self.model.hidden_states(batch, self.kv_cache)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # the pieces' own (not the decode graphs')
        with torch.cuda.stream(stream):
            self._pieces[bucket] = self._capture(batch, self._pool)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def _capture(self, batch: ForwardBatch, pool: object) -> _Pieces:
        graphs = [torch.cuda.CUDAGraph()]
        splits: list[_Split] = []

        def split(call: Callable[..., torch.Tensor], rows: tuple, fixed: tuple) -> torch.Tensor:
            graphs[-1].capture_end()
            # Run once outside the graphs (the warm-up's plan is in force) for the output's
            # shape; its buffer starts zeroed, so padding rows only ever hold finite values.
            shape = call(*rows, *fixed).shape
            key = (tuple(shape[1:]), rows[0].dtype)
            if key not in self._outputs:
                size = (self.max_tokens, *shape[1:])
                self._outputs[key] = torch.zeros(size, dtype=rows[0].dtype, device=self.device)
            out = self._outputs[key][: shape[0]]
            splits.append(_Split(call, rows, fixed, self._outputs[key]))
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=pool)
            return out

        for cut in self.cuts:
            cut.split = split
        graphs[0].capture_begin(pool=pool)
        try:
            states = self.model.hidden_states(batch, self.kv_cache)
        finally:
            for cut in self.cuts:
                cut.split = None
        graphs[-1].capture_end()
        return _Pieces(graphs, splits, states)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The logits of `batch` (its `logits_indices` rows), replaying its bucket's pieces
        (captured: `capture_missing` first)."""
        n = batch.num_tokens
        bucket = self.bucket_for(n)
        self._inputs[0, :n].copy_(batch.input_ids)
        self._inputs[1, :n].copy_(batch.positions)
        self._inputs[2, :n].copy_(batch.slot_mapping)
        self._inputs[:, n:bucket].copy_(self._pad[:, None].expand(-1, bucket - n))
        self.model.prepare(batch)  # the real rows' attention plan
        pieces = self._pieces[bucket]
        for graph, split in zip(pieces.graphs, [*pieces.splits, None], strict=True):
            graph.replay()
            if split is not None:
                split.call(*(t[:n] for t in split.rows), *split.fixed, out=split.out[:n])
        states = tuple(state[:n] for state in pieces.states)
        return self.model.logits(states, batch)

    def _static_batch(self, bucket: int) -> ForwardBatch:
        """The capture batch: `bucket` one-token sequences on the dummy block, over the
        static input buffers (what the pieces read at every replay)."""
        return ForwardBatch(
            input_ids=self._inputs[0, :bucket],
            positions=self._inputs[1, :bucket],
            slot_mapping=self._inputs[2, :bucket],
            logits_indices=torch.arange(bucket, device=self.device),
            block_size=self.block_size,
            query_lens_cpu=[1] * bucket,
            seq_lens_cpu=[1] * bucket,
            block_tables_cpu=[[self.dummy_block]] * bucket,
            query_start_loc_cpu=torch.arange(bucket + 1, dtype=torch.int32),
        )
