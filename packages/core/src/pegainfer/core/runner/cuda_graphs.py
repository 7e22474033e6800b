"""CUDA graphs for decode steps, one per batch-size bucket.

Decode steps are launch-bound: a 36-layer model issues hundreds of small kernels per token.
Each bucket's forward is captured once into a shared memory pool (largest first) over static
input buffers; a step is padded to the next bucket with rows that read and write a reserved
dummy block, its attention is planned outside the graph, and the graph is replayed.

Models with recurrent state read and write each row's state slot in place; padding rows use a
reserved dummy slot, and steps where a state starts or is checkpointed run eagerly.

With data-parallel attention every rank replays the bucket rank 0 chose for the step (the
ranks' collectives must match) and rank 0's forward returns every rank's `bucket` rows of
logits, of which a step keeps each rank's real ones.

Capturing every bucket costs 40-60 ms each (35 buckets: 1.4-2.2 s of a start). A single
process may capture only `first_buckets(...)` before it serves (the smallest ones and the
largest, so every decode step has a graph to pad up to) and the rest later: a step whose own
bucket is still missing captures it first (`capture_missing`), and an idle engine captures the
others (`capture_next`), largest first. Parallel ranks capture every bucket up front: their
graphs hold collectives, captured in the same order on every rank.
"""

from __future__ import annotations

import bisect
import logging

import torch

from pegainfer.core.kv.kv_cache import KVCache
from pegainfer.core.model import Model
from pegainfer.core.runner.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


def graph_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8 up to `max_num_seqs` (itself included)."""
    buckets = {b for b in (1, 2, 4, 8) if b <= max_num_seqs}
    buckets |= set(range(16, max_num_seqs + 1, 8)) | {max_num_seqs}
    return tuple(sorted(buckets))


def first_buckets(buckets: tuple[int, ...]) -> tuple[int, ...]:
    """The buckets captured before serving when the rest may wait: up to 8 rows (a few
    streams' decodes, the common case at first), and the largest (any decode step pads up to
    it until its own is captured)."""
    return tuple(sorted({b for b in buckets if b <= 8} | {max(buckets)}))


class DecodeGraphs:
    def __init__(
        self,
        model: Model,
        kv_cache: KVCache,
        buckets: tuple[int, ...],
        dummy_block: int,
        block_size: int,
        device: torch.device,
        dummy_slot: int | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.buckets = buckets
        self.dummy_block = dummy_block
        self.block_size = block_size
        self.dummy_slot = dummy_slot
        largest = max(buckets)
        # Static inputs: [input_ids, positions, slot_mapping, state slot] per row.
        self._inputs = torch.zeros(4, largest, dtype=torch.int64, device=device)
        self._pad = torch.tensor([0, 0, dummy_block * block_size, dummy_slot or 0], device=device)
        self._inputs.copy_(self._pad[:, None].expand(-1, largest))
        self._rows = torch.arange(largest, device=device)
        # The largest bucket's logits, sized by the first warm-up (with data-parallel
        # attention, every rank's rows on rank 0 and none on the others).
        self._logits: torch.Tensor | None = None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._captured: list[int] = []  # sorted
        self._pool = None  # the graphs' shared memory pool, once one is captured

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(self._captured)

    @property
    def max_batch(self) -> int:
        """The largest bucket captured."""
        return self._captured[-1]

    @property
    def pending(self) -> list[int]:
        """The buckets not captured yet, largest first."""
        return sorted(set(self.buckets) - set(self._captured), reverse=True)

    def bucket_for(self, num_seqs: int) -> int:
        """The smallest captured bucket that holds `num_seqs` rows (at most `max_batch`)."""
        return self._captured[bisect.bisect_left(self._captured, num_seqs)]

    def can_run(self, batch: ForwardBatch) -> bool:
        """Pure decode, every row sampling, within the largest bucket, no state starting (with
        data-parallel attention: on every rank, as rank 0 decided)."""
        if batch.data_parallel is not None:
            return batch.data_parallel.bucket is not None
        n = batch.num_seqs
        restarts = self.dummy_slot is not None and batch.starts_states  # recurrent state only
        return (
            batch.is_decode
            and batch.logits_indices.shape[0] == n
            and n <= self.max_batch
            and not restarts
        )

    def capture(self, buckets: tuple[int, ...] | None = None) -> None:
        """Capture `buckets` (default: every one), largest first."""
        for bucket in sorted(buckets or self.buckets, reverse=True):
            self._capture(bucket)
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s%s", self._captured,
                    f" ({len(self.pending)} more later)" if self.pending else "")  # fmt: skip

    def capture_next(self) -> None:
        """Capture the largest bucket not captured yet (an idle engine's work)."""
        self._capture(self.pending[0])
        torch.cuda.synchronize()
        if not self.pending:
            logger.info("captured every decode CUDA graph (%d batch sizes)", len(self.buckets))

    def capture_missing(self, batch: ForwardBatch) -> None:
        """Capture the bucket of a decode step of `batch`'s size, if it is still missing."""
        if batch.data_parallel is not None or batch.num_seqs > self.buckets[-1]:
            return  # data-parallel ranks capture every bucket up front
        bucket = self.buckets[bisect.bisect_left(self.buckets, batch.num_seqs)]
        if bucket not in self._graphs:
            self._capture(bucket)

    def _capture(self, bucket: int) -> None:
        # Padding rows only (a replay leaves real rows' ids, positions and slots behind):
        # the warm-up and the capture write the dummy block and slot alone.
        self._inputs[:, :bucket].copy_(self._pad[:, None].expand(-1, bucket))
        batch = self._padded(bucket, [], [], [])
        self.model.prepare_graph(batch, bucket)
        # Warm-up: compiles kernels, settles allocations.
        warm = self.model(batch, self.kv_cache)
        if self._logits is None:  # rows for the largest bucket (every rank's, per bucket row)
            rows = warm.shape[0] // bucket * self.buckets[-1]
            self._logits = warm.new_empty(rows, *warm.shape[1:])
        del warm
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.model(batch, self.kv_cache)
            self._logits[: logits.shape[0]].copy_(logits)
        self._pool = graph.pool()
        self._graphs[bucket] = graph
        bisect.insort(self._captured, bucket)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [num_seqs, vocab] of a pure-decode batch, by replaying its bucket's graph
        (with data-parallel attention: every rank's rows, in rank order)."""
        n, counts = batch.num_seqs, batch.data_parallel
        bucket = self.bucket_for(n) if counts is None else counts.bucket
        self._inputs[0, :n].copy_(batch.input_ids)
        self._inputs[1, :n].copy_(batch.positions)
        self._inputs[2, :n].copy_(batch.slot_mapping)
        if batch.state_slots is not None:
            self._inputs[3, :n].copy_(batch.state_slots)
        # Padding rows: token 0 at position 0, writing only the dummy block and dummy slot.
        self._inputs[:, n:bucket].copy_(self._pad[:, None].expand(-1, bucket - n))
        padded = self._padded(
            bucket, batch.seq_lens_cpu, batch.block_tables_cpu, batch.state_slots_cpu
        )
        self.model.prepare_graph(padded, bucket)
        self._graphs[bucket].replay()
        if counts is None:
            return self._logits[:n]
        return torch.cat([self._logits[rank * bucket : rank * bucket + rows]
                          for rank, rows in enumerate(counts.rows)])  # fmt: skip

    def _padded(
        self,
        bucket: int,
        seq_lens: list[int],
        block_tables: list[list[int]],
        state_slots: list[int],
    ) -> ForwardBatch:
        """The static batch of `bucket` rows; rows past the real ones attend the dummy block.

        Its host-side lists are what planning reads. At capture every row is the dummy block's
        one token (a model with state must leave starting states to eager steps: `prepare_graph`
        tells it the step replays a graph)."""
        pad = bucket - len(seq_lens)
        stateful = self.dummy_slot is not None
        return ForwardBatch(
            input_ids=self._inputs[0, :bucket],
            positions=self._inputs[1, :bucket],
            slot_mapping=self._inputs[2, :bucket],
            logits_indices=self._rows[:bucket],
            block_size=self.block_size,
            query_lens_cpu=[1] * bucket,
            seq_lens_cpu=seq_lens + [1] * pad,
            block_tables_cpu=block_tables + [[self.dummy_block]] * pad,
            query_start_loc_cpu=torch.arange(bucket + 1, dtype=torch.int32),
            state_slots_cpu=state_slots + [self.dummy_slot] * pad if stateful else [],
            state_restore_cpu=[None] * bucket if stateful else [],
            state_snapshot_cpu=[None] * bucket if stateful else [],
            state_slots=self._inputs[3, :bucket] if stateful else None,
        )
