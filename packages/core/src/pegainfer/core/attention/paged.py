"""Paged GQA attention: one interface, a torch reference and a FlashInfer implementation.

A model plans attention once per step (`plan`), outside any CUDA graph, then calls `run` in
every layer. The FlashInfer backend runs a step's leading one-token rows (decodes: the
scheduler puts them first) through a decode plan and the rest (prefill chunks) through a
batch-prefill plan, each into its slice of the output; pure-decode steps are captured in CUDA
graphs through a decode wrapper per batch-size bucket with fixed index buffers. Decodes go
apart because the prefill planner picks one query tile for the whole batch from its mean query
length: beside a long prompt, each one-row decode then fills a tile sized for the prompt (at 256
decodes and a 1,024-token prompt on an H200, attention took 14.5 ms a step against 11.3 ms for
the same decodes alone).

FlashInfer decodes with one of two kernels: its CUDA-core decode kernel (`BatchDecode...`,
one module per dtype and head size, GQA groups of 1, 2, 3, 4 and 8 compiled in) or, with
`use_tensor_cores`, its prefill kernel over one query row per sequence, which packs a KV head's
group of query heads into the rows of one MMA tile (the same JIT module as the prefill
wrapper's). `DecodeKernels` picks one per decode batch size: each graph bucket gets its own, and
an eager step's decode rows the one their count picks (`benchmarks/decode_kernels.py` times
both). Where a choice takes the CUDA-core kernel, its module is one more JIT build at its first
plan (~20 s on a cold cache on an H200, then loaded from the cache); the start plans a one-row
and a largest decode batch (`kernels/precompile.py`), so it is loaded before the server is ready
(`tests/core/test_warmup_gpu.py` checks that serving loads no module).
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pegainfer.core.args import DECODE_TENSOR_CORE_MODES, DECODE_TENSOR_CORES_FROM
from pegainfer.core.errors import ConfigError
from pegainfer.core.ops.paged_attention import paged_attention
from pegainfer.core.runner.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from pegainfer.core.model_line import RuntimeConfig

_WORKSPACE_BYTES = 256 << 20
#: A piecewise-graph capture's hook: given a call, its per-token inputs and its other
#: inputs, it ends the current piece and returns the call's output buffer.
Split = Callable[[Callable[..., torch.Tensor], tuple[torch.Tensor, ...], tuple], torch.Tensor]


@dataclass(frozen=True)
class GQAShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


#: GQA group sizes FlashInfer's CUDA-core decode kernel is compiled for (0.6.x: its
#: `batch_decode.cu` dispatches num_qo_heads / num_kv_heads through DISPATCH_GQA_GROUP_SIZE and
#: fails on any other group at plan time).
CUDA_CORE_DECODE_GROUPS = frozenset({1, 2, 3, 4, 8})


@dataclass(frozen=True)
class DecodeKernels:
    """Which of FlashInfer's decode kernels a batch of `rows` decodes runs: tensor cores from
    `tensor_cores_from` rows on (1: always), the CUDA-core kernel below (None: always).

    `auto`'s threshold for groups of 4 and 8 (`DECODE_TENSOR_CORES_FROM`) is 1: tensor cores at
    every batch size. Measured on one H200 at Qwen3-4B's shapes (`benchmarks/decode_kernels.py`
    at ff97473, one layer's call under a CUDA graph), the tensor-core kernel is the faster at
    every batch from 1 to 256 at 1k and 4k of context: 10.5 against 16.6 us at one sequence of
    1k, 27.9 against 31.5 at 16, 294 against 368 at 256 (its KV limit 250 us). The reasoning
    that made the CUDA-core kernel the candidate below 16 sequences (fewer (sequence, KV head)
    pairs than SMs, so attention is bound by latency, not by MMA work) did not hold: its
    latency is the higher one too. The threshold stays a parameter for other GPUs and groups.
    """

    tensor_cores_from: int | None

    def __post_init__(self) -> None:
        if self.tensor_cores_from is not None and self.tensor_cores_from < 1:
            raise ValueError(f"tensor_cores_from must be at least 1, got {self.tensor_cores_from}")

    @classmethod
    def for_mode(
        cls, mode: str, shape: GQAShape, threshold: int = DECODE_TENSOR_CORES_FROM
    ) -> DecodeKernels:
        """`always`, `never`, or `auto`: groups below 4 never use tensor cores (the 16-row MMA
        tile would be mostly padding), groups the CUDA-core kernel lacks always do, groups of 4
        and 8 from `threshold` sequences on."""
        if mode not in DECODE_TENSOR_CORE_MODES:
            raise ConfigError(
                f"decode_attention_tensor_cores must be one of "
                f"{', '.join(DECODE_TENSOR_CORE_MODES)}, got {mode!r}"
            )
        if mode == "always" or (mode == "auto" and shape.group not in CUDA_CORE_DECODE_GROUPS):
            return cls(1)
        if mode == "never" or shape.group < 4:
            choice = cls(None)
            choice.check(shape)
            return choice
        return cls(threshold)

    def tensor_cores(self, rows: int) -> bool:
        return self.tensor_cores_from is not None and rows >= self.tensor_cores_from

    def check(self, shape: GQAShape) -> None:
        """Refuse a choice that would send a group the CUDA-core kernel lacks to it."""
        if self.tensor_cores_from != 1 and shape.group not in CUDA_CORE_DECODE_GROUPS:
            raise ConfigError(
                f"FlashInfer's CUDA-core decode kernel is built for GQA groups of "
                f"{sorted(CUDA_CORE_DECODE_GROUPS)}, not {shape.group} ({shape.num_heads} heads "
                f"over {shape.num_kv_heads} KV heads): decode on tensor cores (always or auto)"
            )


class PagedAttention(ABC):
    """Causal attention of a step's queries over each sequence's paged K/V.

    A cut of piecewise graphs (`runner/piecewise_graphs.py`): while they are captured, `split`
    is set and `run` hands it the call instead of running it.
    """

    def __init__(self, shape: GQAShape) -> None:
        self.shape = shape
        self.split: Split | None = None

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> None:
        """Prepare for `run` calls on `batch` (once per step, never inside a CUDA graph)."""

    def run(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        """q [tokens, heads, head_dim] → output of the same shape, for one layer's cache."""
        if self.split is not None:
            return self.split(self.attend, (q,), (kv_layer,))
        return self.attend(q, kv_layer)

    def attend(
        self, q: torch.Tensor, kv_layer: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`run`'s attention, into `out` if given."""
        return self._attend(q, kv_layer, torch.empty_like(q) if out is None else out)

    @abstractmethod
    def _attend(self, q: torch.Tensor, kv_layer: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The attention, into `out`."""

    def plan_graph(self, batch: ForwardBatch, bucket: int) -> None:
        """Plan a pure-decode batch padded to `bucket` rows for a captured graph."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")


class TorchPagedAttention(PagedAttention):
    """The reference: per-sequence SDPA over gathered blocks."""

    def plan(self, batch: ForwardBatch) -> None:
        self._batch = batch

    def _attend(self, q: torch.Tensor, kv_layer: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(paged_attention(q, kv_layer, self._batch, self.shape.scale))


@dataclass
class PagedIndex:
    """FlashInfer's description of the pages each sequence reads (int32)."""

    kv_indptr: torch.Tensor  # [B + 1] host
    kv_indices: torch.Tensor  # [pages] device
    last_page_len: torch.Tensor  # [B] host

    @classmethod
    def of(cls, batch: ForwardBatch, device: torch.device) -> PagedIndex:
        bs = batch.block_size
        seq_lens = np.asarray(batch.seq_lens_cpu, dtype=np.int32)
        pages = (seq_lens + bs - 1) // bs
        indptr = np.zeros(len(pages) + 1, dtype=np.int32)
        np.cumsum(pages, out=indptr[1:])
        held = [table[:p] for table, p in zip(batch.block_tables_cpu, pages.tolist(), strict=True)]
        indices = np.fromiter(chain.from_iterable(held), np.int32, int(indptr[-1]))
        return cls(
            kv_indptr=torch.from_numpy(indptr).pin_memory(),
            kv_indices=torch.from_numpy(indices).pin_memory().to(device, non_blocking=True),
            last_page_len=torch.from_numpy(seq_lens - (pages - 1) * bs).pin_memory(),
        )

    def split(self, seqs: int) -> tuple[PagedIndex, PagedIndex]:
        """The first `seqs` sequences' pages and the others' (indptrs rebased to 0)."""
        cut = int(self.kv_indptr[seqs])
        head = PagedIndex(self.kv_indptr[: seqs + 1], self.kv_indices[:cut],
                          self.last_page_len[:seqs])  # fmt: skip
        tail = PagedIndex((self.kv_indptr[seqs:] - cut).pin_memory(), self.kv_indices[cut:],
                          self.last_page_len[seqs:])  # fmt: skip
        return head, tail


def leading_decodes(batch: ForwardBatch) -> int:
    """How many sequences at the start of `batch` have one query row."""
    lens = np.asarray(batch.query_lens_cpu)
    longer = np.flatnonzero(lens != 1)
    return int(longer[0]) if len(longer) else len(lens)


class PlanStaging:
    """FlashInfer's plan() stages its schedule in a pinned host buffer and copies it
    asynchronously; planning again before that copy ran would overwrite it in flight. Each
    plan runs as `with staging: wrapper.plan(...)`, after the previous one's copy."""

    def __init__(self) -> None:
        self._planned: torch.cuda.Event | None = None

    def __enter__(self) -> None:
        if self._planned is not None:
            self._planned.synchronize()

    def __exit__(self, *exc: object) -> None:
        self._planned = torch.cuda.Event()
        self._planned.record()


# What each FlashInfer wrapper allocates for its plans (0.6.x): an int workspace on the device
# (the schedule plan() makes, read by run()) and a pinned host mirror it is staged in, 8 MiB
# each. Names are FlashInfer's own (no public setter keeps the pinned mirror shared).
_PLAN_BUFFERS = ("_int_workspace_buffer", "_pin_memory_int_workspace_buffer")


def share_plan_buffers(wrappers: list[Any]) -> None:
    """Give every wrapper the first one's plan buffers (device int workspace, pinned host
    mirror), freeing the others' (the caching allocators reuse them for the next wrapper).

    Sound for wrappers that never hold live plans at once and plan under one `PlanStaging`:
    the decode-graph wrappers, one bucket per step, each planned right before it replays
    (its graph reads the schedule from fixed offsets of the shared workspace, which its own
    plan has just rewritten, in stream order after the last replay read it). FlashInfer
    shares the float workspace between such wrappers itself. With one set per graph wrapper,
    Qwen3-4B's 33 buckets held 264 MiB of pinned host memory and as much on the device."""
    if not wrappers:
        return
    first = wrappers[0]
    for name in _PLAN_BUFFERS:
        if not isinstance(getattr(first, name, None), torch.Tensor):
            raise RuntimeError(
                f"{type(first).__name__} has no tensor {name}: this FlashInfer version lays "
                "out its plan buffers differently (share_plan_buffers follows 0.6.x)"
            )
    for wrapper in wrappers[1:]:
        for name in _PLAN_BUFFERS:
            setattr(wrapper, name, getattr(first, name))


class FlashInferPagedAttention(PagedAttention):
    def __init__(
        self,
        shape: GQAShape,
        dtype: torch.dtype,
        device: torch.device,
        max_pages_per_seq: int,
        graph_buckets: tuple[int, ...] = (),
        decode_kernels: DecodeKernels | None = None,
        prefill_backend: str = "fa2",
    ) -> None:
        """`decode_kernels`: by default `auto`'s choice for the shape. `prefill_backend`:
        FlashInfer's kernel family for the prefill rows, "fa2" (what the engine runs) or "fa3"
        (Hopper's; `benchmarks/prefill_attention.py` compares the two)."""
        import flashinfer

        super().__init__(shape)
        self.dtype = dtype
        self.device = device
        self.decode_kernels = decode_kernels or DecodeKernels.for_mode("auto", shape)
        self.decode_kernels.check(shape)
        self._workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", backend=prefill_backend
        )
        # One set of index buffers, sliced per bucket: graphs replay one at a time.
        largest = max(graph_buckets, default=0)
        indptr = torch.zeros(largest + 1, dtype=torch.int32, device=device)
        indices = torch.zeros(largest * max_pages_per_seq, dtype=torch.int32, device=device)
        last_page_len = torch.zeros(largest, dtype=torch.int32, device=device)
        self._graph_decode = {
            bucket: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.decode_kernels.tensor_cores(bucket),
                paged_kv_indptr_buffer=indptr[: bucket + 1],
                paged_kv_indices_buffer=indices[: bucket * max_pages_per_seq],
                paged_kv_last_page_len_buffer=last_page_len[:bucket],
            )
            for bucket in graph_buckets
        }
        share_plan_buffers(list(self._graph_decode.values()))  # planned under _graph_staging
        # Eager steps: decode rows (through the kernel their count picks), then prefill rows.
        # The wrappers share the workspace (their runs follow each other on one stream); the
        # decode wrappers, of which a step plans one, share plan buffers and their staging.
        kinds = {self.decode_kernels.tensor_cores(rows) for rows in (1, sys.maxsize)}
        self._decode = {
            kind: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=kind
            )
            for kind in sorted(kinds)
        }
        share_plan_buffers(list(self._decode.values()))
        # (wrapper, first row, rows) of the step planned, in order.
        self._active: list[tuple[Any, int, int]] = []
        self._decode_staging, self._prefill_staging = PlanStaging(), PlanStaging()
        self._graph_staging = PlanStaging()

    def plan(self, batch: ForwardBatch) -> None:
        index = PagedIndex.of(batch, self.device)
        decodes = leading_decodes(batch)
        self._active = []
        if decodes:
            head, index = index.split(decodes) if decodes < batch.num_seqs else (index, None)
            wrapper = self._decode[self.decode_kernels.tensor_cores(decodes)]
            self._plan_decode(wrapper, head, batch.block_size, self._decode_staging)
            self._active.append((wrapper, 0, decodes))
        if index is None:
            return
        qo_indptr = batch.query_start_loc_cpu[decodes:] - decodes
        s = self.shape
        with self._prefill_staging:
            self._prefill.plan(
                qo_indptr.pin_memory(),
                index.kv_indptr,
                index.kv_indices,
                index.last_page_len,
                s.num_heads,
                s.num_kv_heads,
                s.head_dim,
                batch.block_size,
                causal=True,
                sm_scale=s.scale,
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
            )
        self._active.append((self._prefill, decodes, batch.num_tokens - decodes))

    def plan_graph(self, batch: ForwardBatch, bucket: int) -> None:
        index = PagedIndex.of(batch, self.device)
        wrapper = self._graph_decode[bucket]
        self._plan_decode(wrapper, index, batch.block_size, self._graph_staging)
        self._active = [(wrapper, 0, bucket)]

    def _plan_decode(
        self, wrapper: Any, index: PagedIndex, block_size: int, staging: PlanStaging
    ) -> None:
        s = self.shape
        with staging:
            wrapper.plan(
                index.kv_indptr,
                index.kv_indices,
                index.last_page_len,
                s.num_heads,
                s.num_kv_heads,
                s.head_dim,
                block_size,
                sm_scale=s.scale,
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
            )

    def _attend(self, q: torch.Tensor, kv_layer: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        # Into a preallocated output: without one, the prefill wrapper zero-fills its own.
        for wrapper, start, rows in self._active:
            wrapper.run(q[start : start + rows], kv_layer, out=out[start : start + rows])
        return out


def make_paged_attention(
    shape: GQAShape,
    dtype: torch.dtype,
    device: torch.device,
    max_pages_per_seq: int,
    graph_buckets: tuple[int, ...] = (),
    decode_tensor_cores: str = "auto",
) -> PagedAttention:
    """FlashInfer on CUDA, the torch reference elsewhere (`decode_tensor_cores`, one of
    `DECODE_TENSOR_CORE_MODES`, is checked on both)."""
    kernels = DecodeKernels.for_mode(decode_tensor_cores, shape)
    if device.type == "cuda":
        return FlashInferPagedAttention(
            shape, dtype, device, max_pages_per_seq, graph_buckets, kernels
        )
    return TorchPagedAttention(shape)


def runtime_paged_attention(
    shape: GQAShape, dtype: torch.dtype, device: torch.device, runtime: RuntimeConfig
) -> PagedAttention:
    """`make_paged_attention` for the engine's runtime (its pages, graph buckets and decode
    kernels)."""
    pages, buckets = runtime.max_pages_per_seq, runtime.graph_buckets
    return make_paged_attention(
        shape, dtype, device, pages, buckets, runtime.decode_attention_tensor_cores
    )
