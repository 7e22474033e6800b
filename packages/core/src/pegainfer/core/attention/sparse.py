"""DeepSeek sparse attention (DSA) over the paged latent cache: each query row attends (MLA,
absorbed form) only to the `top_k` keys a lightning indexer selects for it. GLM-5 and
DeepSeek-V3.2 attend this way; the maths is in `ops.sparse_attention`.

Per step the model plans once (`plan`, outside any CUDA graph), then in every layer with an
indexer asks for the selection (`select`: its queries and weights over that layer's indexer-key
arena) and attends over it (`run`); a layer that shares the previous indexer layer's selection
(GLM-5.2's `indexer_types`) passes that one on.

While a sequence has no more keys than `top_k`, each of its rows selects every key it sees:
attention is exactly dense MLA, and an eager step runs its chunk through core's
`MultiHeadLatentAttention` (expanded or absorbed, as cost decides) without scoring it; only the
longer sequences' rows are scored and attend sparsely (`select` returns None when no sequence is
longer). The indexer keys are still written for every token (later rows score them).

On CUDA the scores are one Triton kernel (`kernels.indexer`), the top-k is torch's, and
attention is FlashInfer's MLA over a page-size-1 view of the cache whose "pages" are each row's
selected slots (one request per row, not causal: the selection is). Decode steps replay CUDA
graphs: their scores span `max_model_len` columns (blocks past a row's length only store -inf)
and their selections land in fixed index buffers. Elsewhere the torch references run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pegainfer.core.attention.latent import (
    MLA_PLAN_WORK_ITEMS,
    LatentShape,
    MultiHeadLatentAttention,
    absorb_query,
    make_latent_attention,
    mla_plan_work_items,
    project_values,
    sequence_rows,
    sub_batch,
)
from pegainfer.core.attention.paged import PlanStaging, share_plan_buffers
from pegainfer.core.errors import ConfigError
from pegainfer.core.model_line import RuntimeConfig
from pegainfer.core.ops import sparse_attention
from pegainfer.core.runner.forward_batch import ForwardBatch, to_device_array

# The most score entries (rows × columns, float32) one `select` call holds at once: an eager
# step's rows are scored in chunks of at most this many entries.
_SCORE_ENTRIES = 1 << 27


@dataclass(frozen=True)
class IndexerShape:
    """The lightning indexer's queries (`heads` × `dim` per row), its keys (`dim`), the scale
    inside its ReLU, and how many keys each row keeps."""

    heads: int
    dim: int
    top_k: int
    scale: float


@dataclass
class SparseStep:
    """One sparse step's rows as the indexer addresses them (`ops.sparse_attention`)."""

    positions: torch.Tensor  # [rows] on the device: row t sees positions[t] + 1 keys
    seq_of_row: torch.Tensor  # [rows] int32 on the device
    seq_starts: torch.Tensor  # [sequences] int32 on the device: each one's first row
    block_tables: torch.Tensor  # [sequences, pages] int32 on the device
    block_size: int
    columns: int  # scores per row: the step's longest sequence (a graph: max_model_len)
    top_k: int  # selected slots per row (valid ones: `counts`)
    counts: torch.Tensor  # [rows] int32 on the device
    counts_cpu: np.ndarray  # [rows] int32


# One layer's scores for rows `rows` of a step: (q, weights, k_layer, step, rows, scale).
Scores = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, SparseStep, slice, float],
                  torch.Tensor]  # fmt: skip


def reference_scores(
    q: torch.Tensor, weights: torch.Tensor, k_layer: torch.Tensor, step: SparseStep,
    rows: slice, scale: float,
) -> torch.Tensor:  # fmt: skip
    """`ops.sparse_attention.indexer_scores` for rows `rows` of the step."""
    return sparse_attention.indexer_scores(
        q[rows], weights[rows], k_layer, step.block_tables, step.seq_of_row[rows],
        step.positions[rows] + 1, step.columns, scale,
    )  # fmt: skip


def kernel_scores(
    q: torch.Tensor, weights: torch.Tensor, k_layer: torch.Tensor, step: SparseStep,
    rows: slice, scale: float,
) -> torch.Tensor:  # fmt: skip
    """The Triton kernel (`kernels.indexer`) for rows `rows` of the step."""
    from pegainfer.core.kernels.indexer import indexer_scores

    return indexer_scores(
        q[rows], weights[rows], k_layer, step.block_tables, step.seq_of_row[rows],
        step.positions[rows] + 1, step.columns, scale, step.seq_starts, rows.start,
    )  # fmt: skip


def _step_counts(batch: ForwardBatch, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's sequence and number of valid selected keys, min(top_k, position + 1)."""
    q_lens = np.asarray(batch.query_lens_cpu, dtype=np.int64)
    seq_lens = np.asarray(batch.seq_lens_cpu, dtype=np.int64)
    seq_of_row = np.repeat(np.arange(len(q_lens), dtype=np.int64), q_lens)
    ends = np.cumsum(q_lens)
    # Row t of sequence i sits at position seq_len - (end - t) and sees one more key.
    seen = np.repeat(seq_lens - ends, q_lens) + np.arange(int(ends[-1]) if len(ends) else 0) + 1
    return seq_of_row.astype(np.int32), np.minimum(seen, top_k).astype(np.int32)


def _padded_tables(batch: ForwardBatch, pages: int) -> np.ndarray:
    """The step's block tables cut or padded (with block 0, never read) to `pages` columns."""
    tables = np.zeros((batch.num_seqs, pages), dtype=np.int32)
    for i, table in enumerate(batch.block_tables_cpu):
        held = table[:pages]
        tables[i, : len(held)] = held
    return tables


class SparseLatentBackend(ABC):
    """The absorbed form's attention over each row's selected slots."""

    def __init__(self, shape: LatentShape) -> None:
        self.shape = shape

    @abstractmethod
    def plan(self, step: SparseStep) -> None:
        """Prepare for `run` calls on `step` (once per step, never inside a CUDA graph)."""

    def plan_graph(self, step: SparseStep, bucket: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    @abstractmethod
    def run(
        self,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        ckv_layer: torch.Tensor,
        kpe_layer: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """q_latent [rows, heads, latent], q_pe [rows, heads, rope], slots [rows, top_k] → out
        [rows, heads, latent]."""


class TorchSparseLatent(SparseLatentBackend):
    """The reference (`ops.sparse_attention.sparse_latent_attention`)."""

    def plan(self, step: SparseStep) -> None:
        self._counts = step.counts

    def plan_graph(self, step: SparseStep, bucket: int) -> None:
        """A padded decode batch, run eagerly (the reference is never captured)."""
        self.plan(step)

    def run(self, q_latent, q_pe, ckv_layer, kpe_layer, slots) -> torch.Tensor:
        return sparse_attention.sparse_latent_attention(
            q_latent, q_pe, ckv_layer, kpe_layer, slots, self._counts, self.shape.scale
        )


def rows_per_plan(num_heads: int, num_sms: int) -> int:
    """The most one-row requests one FlashInfer MLA plan holds (its planner's work items)."""
    low, high = 1, MLA_PLAN_WORK_ITEMS
    while low < high:
        mid = (low + high + 1) // 2
        if mla_plan_work_items(num_heads, mid, mid, num_sms) <= MLA_PLAN_WORK_ITEMS:
            low = mid
        else:
            high = mid - 1
    return low


def packed_places(
    counts: np.ndarray, device_counts: torch.Tensor, top_k: int, out: torch.Tensor
) -> np.ndarray:
    """Where each row's valid slots sit in a [rows, top_k] selection, rows packed one after
    another (row i's j-th slot: i * top_k + j), into `out` on `device_counts`' device, zero
    past them; returns the packed rows' offsets (kv_indptr, host). Built on the device: a
    step has rows × top_k places and only its rows' counts cross from the host."""
    rows = len(counts)
    kv_indptr = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(counts, out=kv_indptr[1:])
    total = int(kv_indptr[-1])
    shift = np.arange(rows, dtype=np.int64) * top_k - kv_indptr[:-1]
    torch.add(
        torch.arange(total, device=out.device),
        torch.repeat_interleave(to_device_array(shift, out.device), device_counts.long(),
                                output_size=total),
        out=out[:total],
    )  # fmt: skip
    out[total:].zero_()
    return kv_indptr


@dataclass
class _Planned:
    """One FlashInfer plan over rows [start, end): the slots it reads (packed, one row's after
    another) and where in the step's [rows, top_k] selection each comes from."""

    wrapper: object
    staging: PlanStaging
    start: int
    end: int
    kv_indices: torch.Tensor
    gather: torch.Tensor


class FlashInferSparseLatent(SparseLatentBackend):
    """FlashInfer's MLA with page size 1: each row is a request whose pages are its selected
    slots, packed (`kv_indptr` from the host-known counts). An eager step's rows are split
    between plans of at most `rows_per_plan` rows (the planner's capacity); each graph bucket
    has its own wrapper over fixed buffers into which `run` gathers the selection."""

    def __init__(
        self,
        shape: LatentShape,
        dtype: torch.dtype,
        device: torch.device,
        workspace: torch.Tensor,
        max_rows: int,
        graph_buckets: tuple[int, ...],
        top_k: int,
        backend: str = "fa2",
    ) -> None:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        super().__init__(shape)
        self.dtype, self.device, self.backend = dtype, device, backend
        self.workspace = workspace
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.rows_per_plan = rows_per_plan(shape.num_heads, sms)
        plans = -(-max_rows // self.rows_per_plan)
        # Each eager wrapper stages its plans in its own pinned buffer (`PlanStaging`).
        self._eager = [(BatchMLAPagedAttentionWrapper(workspace, backend=backend), PlanStaging())
                       for _ in range(plans)]  # fmt: skip
        largest = max(graph_buckets, default=0)
        if largest > self.rows_per_plan:
            raise ConfigError(
                f"a decode graph of {largest} rows at {shape.num_heads} heads overruns "
                f"FlashInfer's MLA planner ({self.rows_per_plan} rows): lower --max-num-seqs"
            )
        i32 = {"dtype": torch.int32, "device": device}
        indices = torch.zeros(largest * top_k, **i32)
        gather = torch.zeros(largest * top_k, dtype=torch.int64, device=device)
        qo_indptr, kv_indptr = torch.zeros(largest + 1, **i32), torch.zeros(largest + 1, **i32)
        kv_lens = torch.zeros(largest, **i32)
        self._graph: dict[int, _Planned] = {}
        graph_staging = PlanStaging()  # one bucket's plan per step: they share plan buffers
        for bucket in graph_buckets:
            # The wrapper's index buffer is the very tensor each plan passes (copying it onto
            # itself is skipped) and `run` gathers the selection into.
            width = bucket * top_k
            kv_indices = indices[:width]
            wrapper = BatchMLAPagedAttentionWrapper(
                workspace, use_cuda_graph=True, qo_indptr=qo_indptr[: bucket + 1],
                kv_indptr=kv_indptr[: bucket + 1], kv_indices=kv_indices,
                kv_len_arr=kv_lens[:bucket], backend=backend,
            )  # fmt: skip
            self._graph[bucket] = _Planned(wrapper, graph_staging, 0, bucket, kv_indices,
                                           gather[:width])  # fmt: skip
        share_plan_buffers([planned.wrapper for planned in self._graph.values()])
        self._planned: list[_Planned] = []

    def _plan_rows(self, planned: _Planned, counts: np.ndarray, device_counts: torch.Tensor,
                   top_k: int) -> None:  # fmt: skip
        """Plan rows with `counts` valid slots each (`device_counts` on the device); fill
        `gather` with the packed slots' places in a [rows, top_k] selection, on the device
        (a step has rows × top_k of them), zero past them."""
        rows = len(counts)
        kv_indptr = packed_places(counts, device_counts, top_k, planned.gather)
        s = self.shape
        with planned.staging:
            planned.wrapper.plan(
                torch.arange(rows + 1, dtype=torch.int32).pin_memory(),
                torch.from_numpy(kv_indptr).pin_memory(),
                planned.kv_indices,
                torch.from_numpy(np.ascontiguousarray(counts)).pin_memory(),
                s.num_heads, s.latent_dim, s.rope_dim,
                1,  # page size: a "page" is one selected slot
                False,  # the selection is already causal
                s.scale, self.dtype, self.dtype,
            )  # fmt: skip

    def plan(self, step: SparseStep) -> None:
        self._planned = []
        n = len(step.counts_cpu)
        for i, start in enumerate(range(0, n, self.rows_per_plan)):
            end = min(start + self.rows_per_plan, n)
            counts = step.counts_cpu[start:end]
            total = int(counts.sum())
            planned = _Planned(
                *self._eager[i], start, end,
                torch.empty(total, dtype=torch.int32, device=self.device),
                torch.empty(total, dtype=torch.int64, device=self.device),
            )  # fmt: skip
            self._plan_rows(planned, counts, step.counts[start:end], step.top_k)
            self._planned.append(planned)

    def plan_graph(self, step: SparseStep, bucket: int) -> None:
        planned = self._graph[bucket]
        self._plan_rows(planned, step.counts_cpu, step.counts, step.top_k)
        self._planned = [planned]

    def run(self, q_latent, q_pe, ckv_layer, kpe_layer, slots) -> torch.Tensor:
        ckv = ckv_layer.view(-1, 1, ckv_layer.shape[-1])
        kpe = kpe_layer.view(-1, 1, kpe_layer.shape[-1])
        if len(self._planned) == 1:
            p = self._planned[0]
            torch.index_select(slots.reshape(-1), 0, p.gather, out=p.kv_indices)
            return p.wrapper.run(q_latent, q_pe, ckv, kpe)
        out = torch.empty_like(q_latent)
        for p in self._planned:
            rows = slice(p.start, p.end)
            torch.index_select(slots[rows].reshape(-1), 0, p.gather, out=p.kv_indices)
            out[rows] = p.wrapper.run(q_latent[rows], q_pe[rows], ckv, kpe)
        return out


class SparseLatentAttention:
    """A model's DSA attention. An eager step's sequences that fit in `top_k` keys attend
    dense MLA (`dense`: their chunks as cheap as without an indexer); the others' rows, and
    every row of a decode graph, attend `sparse`ly over the indexer's selection, which only
    they need."""

    def __init__(
        self,
        indexer: IndexerShape,
        dense: MultiHeadLatentAttention,
        sparse: SparseLatentBackend,
        scores: Scores,
        runtime: RuntimeConfig,
        device: torch.device,
    ) -> None:
        self.indexer = indexer
        self.dense = dense
        self.sparse = sparse
        self.scores = scores
        self.max_model_len = runtime.max_model_len
        self.device = device
        self._step: SparseStep | None = None
        #: In a step of both kinds: the dense sequences' rows and the sparse ones' (device).
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None
        pages = runtime.max_pages_per_seq
        largest = max(runtime.graph_buckets, default=0)
        self._graph_tables = torch.zeros(largest, pages, dtype=torch.int32, device=device)
        self._graph_rows = torch.arange(largest, dtype=torch.int32, device=device)
        self._graph_counts = torch.zeros(largest, dtype=torch.int32, device=device)

    @property
    def transient_bytes(self) -> int:
        """The dense form's, or one chunk of scores and its top-k, whichever is larger."""
        return max(self.dense.transient_bytes, _SCORE_ENTRIES * 4 * 2)

    @property
    def step(self) -> SparseStep | None:
        """This step's rows as the indexer addresses them (None: a dense step)."""
        return self._step

    @property
    def is_sparse(self) -> bool:
        """Whether this step's rows attend to their selections."""
        return self._step is not None

    def plan(self, batch: ForwardBatch) -> None:
        """Plan an eager step: sequences of at most top_k keys dense, the others sparse."""
        top_k = self.indexer.top_k
        long = [i for i, n in enumerate(batch.seq_lens_cpu) if n > top_k]
        self._rows = None
        if not long:
            self._step = None
            self.dense.plan(batch)
            return
        if len(long) == batch.num_seqs:
            self._step = self._sparse_step(batch, batch.positions)
        else:
            short = [i for i, n in enumerate(batch.seq_lens_cpu) if n <= top_k]
            self.dense.plan(sub_batch(batch, short))
            rows = [to_device_array(sequence_rows(batch, seqs).numpy(), self.device)
                    for seqs in (short, long)]  # fmt: skip
            self._rows = (rows[0], rows[1])
            self._step = self._sparse_step(sub_batch(batch, long), batch.positions[rows[1]])
        self.sparse.plan(self._step)

    def _sparse_step(self, batch: ForwardBatch, positions: torch.Tensor) -> SparseStep:
        """The sparse rows of an eager step: `batch`'s (its rows' `positions`)."""
        columns = max(batch.seq_lens_cpu)
        seq_of_row, counts = _step_counts(batch, self.indexer.top_k)
        bs = batch.block_size
        tables = _padded_tables(batch, -(-columns // bs))
        starts = batch.query_start_loc_cpu[:-1].numpy()
        host = np.concatenate([seq_of_row, starts, counts, tables.reshape(-1)])
        device = to_device_array(host, self.device).split(
            [len(seq_of_row), len(starts), len(counts), tables.size]
        )
        return SparseStep(
            positions=positions, seq_of_row=device[0], seq_starts=device[1],
            block_tables=device[3].view(tables.shape), block_size=bs, columns=columns,
            top_k=self.indexer.top_k, counts=device[2], counts_cpu=counts,
        )  # fmt: skip

    def plan_graph(self, batch: ForwardBatch, bucket: int) -> None:
        """Plan a decode batch padded to `bucket` rows for a graph: always sparse, over
        `max_model_len` columns (its rows select all their keys until they outgrow top_k)."""
        top_k = min(self.indexer.top_k, self.max_model_len)
        _, counts = _step_counts(batch, top_k)
        tables = _padded_tables(batch, self._graph_tables.shape[1])
        width = max(1, max(len(t) for t in batch.block_tables_cpu))
        self._graph_tables[:bucket, :width].copy_(
            to_device_array(np.ascontiguousarray(tables[:, :width]), self.device)
        )
        self._graph_counts[:bucket].copy_(to_device_array(counts, self.device))
        self._rows = None
        self._step = SparseStep(
            positions=batch.positions, seq_of_row=self._graph_rows[:bucket],
            seq_starts=self._graph_rows[:bucket], block_tables=self._graph_tables[:bucket],
            block_size=batch.block_size, columns=self.max_model_len, top_k=top_k,
            counts=self._graph_counts[:bucket], counts_cpu=counts,
        )  # fmt: skip
        self.sparse.plan_graph(self._step, bucket)

    def select(
        self, q: torch.Tensor, weights: torch.Tensor, k_layer: torch.Tensor
    ) -> torch.Tensor | None:
        """The cache slots each sparse row attends to ([sparse rows, top_k] int32, best
        first), from the indexer's queries q [rows, heads, dim] and head weights [rows, heads]
        of the step's rows over one layer's indexer keys [blocks, block_size, dim] (this
        step's already written); None in a dense step."""
        step = self._step
        if step is None:
            return None
        if self._rows is not None:
            q, weights = q[self._rows[1]], weights[self._rows[1]]
        rows = q.shape[0]
        chunk = max(1, _SCORE_ENTRIES // step.columns)
        parts = []
        for start in range(0, rows, chunk):
            part = slice(start, min(start + chunk, rows))
            scores = self.scores(q, weights, k_layer, step, part, self.indexer.scale)
            parts.append(sparse_attention.top_k_slots(
                scores, step.top_k, step.block_tables, step.seq_of_row[part], step.block_size
            ))  # fmt: skip
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def run(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        ckv_layer: torch.Tensor,
        kpe_layer: torch.Tensor,
        kv_b: torch.Tensor,
        selection: torch.Tensor | None,
    ) -> torch.Tensor:
        """q_nope [rows, heads, nope], q_pe [rows, heads, rope] (roped), one layer's caches
        (this step's latents written), its up-projection kv_b [heads, nope + value, latent] and
        the selection that layer attends over (`select`'s) → out [rows, heads, value]."""
        if self._step is None:
            return self.dense.run(q_nope, q_pe, ckv_layer, kpe_layer, kv_b)
        if selection is None:
            raise ValueError("a sparse step's attention needs the indexer's selection")
        if self._rows is None:
            return self._sparse(q_nope, q_pe, ckv_layer, kpe_layer, kv_b, selection)
        dense, sparse = self._rows
        out = q_nope.new_empty(*q_nope.shape[:2], self.dense.shape.value_dim)
        out[dense] = self.dense.run(q_nope[dense], q_pe[dense], ckv_layer, kpe_layer, kv_b)
        out[sparse] = self._sparse(q_nope[sparse], q_pe[sparse], ckv_layer, kpe_layer, kv_b,
                                   selection)  # fmt: skip
        return out

    def _sparse(self, q_nope, q_pe, ckv_layer, kpe_layer, kv_b, selection) -> torch.Tensor:
        nope = self.dense.shape.nope_dim
        latent = self.sparse.run(
            absorb_query(q_nope, kv_b[:, :nope]), q_pe, ckv_layer, kpe_layer, selection
        )
        return project_values(latent, kv_b[:, nope:])


def make_sparse_latent_attention(
    shape: LatentShape,
    indexer: IndexerShape,
    dtype: torch.dtype,
    device: torch.device,
    runtime: RuntimeConfig,
) -> SparseLatentAttention:
    """FlashInfer and the Triton scores on CUDA for the latent sizes FlashInfer covers, the
    torch references otherwise."""
    dense = make_latent_attention(shape, dtype, device, runtime)
    if device.type == "cuda" and shape.flashinfer_supported:
        workspace = dense.absorbed.workspace
        rows = max(runtime.max_num_batched_tokens, max(runtime.graph_buckets, default=0))
        top_k = min(indexer.top_k, runtime.max_model_len)
        sparse: SparseLatentBackend = FlashInferSparseLatent(
            shape, dtype, device, workspace, rows, runtime.graph_buckets, top_k
        )
        scores: Scores = kernel_scores
    else:
        sparse, scores = TorchSparseLatent(shape), reference_scores
    return SparseLatentAttention(indexer, dense, sparse, scores, runtime, device)
