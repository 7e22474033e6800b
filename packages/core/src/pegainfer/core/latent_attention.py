"""Paged latent (MLA) attention: one interface, a torch reference and a FlashInfer backend.

Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, GLM-5) caches per token one latent and
one roped key shared by all heads (`ops.latent_attention`). A line absorbs its key
up-projection into the query and its value up-projection after the output, so attention runs
in latent space for every row, prefill chunks and decodes alike, and never expands the cache.

As for GQA (`core.attention`), a model plans once per step outside any CUDA graph and calls
`run` in every layer; pure-decode steps replay graphs planned per batch-size bucket over fixed
index buffers. FlashInfer's MLA kernels take a latent of 512 and a rope key of 64 (every
DeepSeek-V2/V3-style checkpoint); other sizes (the tiny test models) run the reference.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from pegainfer.core.attention import PagedIndex
from pegainfer.core.forward_batch import ForwardBatch
from pegainfer.core.ops.latent_attention import paged_latent_attention

_WORKSPACE_BYTES = 128 << 20
# (latent_dim, rope_dim) FlashInfer's MLA kernels are built for.
FLASHINFER_LATENT_SHAPES = {(512, 64)}


@dataclass(frozen=True)
class LatentShape:
    num_heads: int
    latent_dim: int
    rope_dim: int
    #: Softmax scale of the scores (the line's, e.g. with YaRN's mscale folded in).
    scale: float

    @property
    def flashinfer_supported(self) -> bool:
        return (self.latent_dim, self.rope_dim) in FLASHINFER_LATENT_SHAPES


class PagedLatentAttention(ABC):
    """Causal attention of a step's absorbed queries over each sequence's paged latents."""

    def __init__(self, shape: LatentShape) -> None:
        self.shape = shape

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> None:
        """Prepare for `run` calls on `batch` (once per step, never inside a CUDA graph)."""

    @abstractmethod
    def run(
        self,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        ckv_layer: torch.Tensor,
        kpe_layer: torch.Tensor,
    ) -> torch.Tensor:
        """q_latent [tokens, heads, latent], q_pe [tokens, heads, rope] → out [tokens, heads,
        latent], over one layer's caches."""

    def plan_graph(self, batch: ForwardBatch, bucket: int) -> None:
        """Plan a pure-decode batch padded to `bucket` rows for a captured graph."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")


class TorchPagedLatentAttention(PagedLatentAttention):
    """The reference: per-sequence attention over gathered blocks."""

    def plan(self, batch: ForwardBatch) -> None:
        self._batch = batch

    def run(
        self,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        ckv_layer: torch.Tensor,
        kpe_layer: torch.Tensor,
    ) -> torch.Tensor:
        return paged_latent_attention(
            q_latent, q_pe, ckv_layer, kpe_layer, self._batch, self.shape.scale
        )


class FlashInferPagedLatentAttention(PagedLatentAttention):
    """FlashInfer's batched MLA: one plan covers a mixed step (prefill chunks are causal
    queries of several rows, decodes of one); each graph bucket has its own wrapper over
    slices of one set of fixed index buffers (graphs replay one at a time). The FA2 backend,
    FlashInfer's general one (FA3's Hopper kernels are the next thing to measure)."""

    def __init__(
        self,
        shape: LatentShape,
        dtype: torch.dtype,
        device: torch.device,
        max_pages_per_seq: int,
        graph_buckets: tuple[int, ...] = (),
    ) -> None:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        if not shape.flashinfer_supported:
            raise ValueError(f"FlashInfer's MLA kernels do not cover {shape}")
        super().__init__(shape)
        self.dtype = dtype
        self.device = device
        self._workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._eager = BatchMLAPagedAttentionWrapper(self._workspace, backend="fa2")
        largest = max(graph_buckets, default=0)
        qo_indptr = torch.arange(largest + 1, dtype=torch.int32, device=device)
        kv_indptr = torch.zeros(largest + 1, dtype=torch.int32, device=device)
        kv_indices = torch.zeros(largest * max_pages_per_seq, dtype=torch.int32, device=device)
        kv_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self._graph = {
            bucket: BatchMLAPagedAttentionWrapper(
                self._workspace,
                use_cuda_graph=True,
                qo_indptr=qo_indptr[: bucket + 1],
                kv_indptr=kv_indptr[: bucket + 1],
                kv_indices=kv_indices[: bucket * max_pages_per_seq],
                kv_len_arr=kv_lens[:bucket],
                backend="fa2",
            )
            for bucket in graph_buckets
        }
        self._active = self._eager
        self._planned: torch.cuda.Event | None = None

    def _plan(self, wrapper, batch: ForwardBatch) -> None:
        # FlashInfer stages a plan's schedule in one pinned host buffer and copies it
        # asynchronously: planning again before that copy ran would overwrite it in flight.
        if self._planned is not None:
            self._planned.synchronize()
        index = PagedIndex.of(batch, self.device)
        s = self.shape
        wrapper.plan(
            batch.query_start_loc_cpu.pin_memory(),
            index.kv_indptr,
            index.kv_indices,
            torch.tensor(batch.seq_lens_cpu, dtype=torch.int32).pin_memory(),
            s.num_heads,
            s.latent_dim,
            s.rope_dim,
            batch.block_size,
            True,  # causal: a chunk's rows see the cache up to their own positions
            s.scale,
            self.dtype,
            self.dtype,
        )
        self._planned = torch.cuda.Event()
        self._planned.record()
        self._active = wrapper

    def plan(self, batch: ForwardBatch) -> None:
        self._plan(self._eager, batch)

    def plan_graph(self, batch: ForwardBatch, bucket: int) -> None:
        self._plan(self._graph[bucket], batch)

    def run(
        self,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        ckv_layer: torch.Tensor,
        kpe_layer: torch.Tensor,
    ) -> torch.Tensor:
        return self._active.run(q_latent, q_pe, ckv_layer, kpe_layer)


def make_latent_attention(
    shape: LatentShape,
    dtype: torch.dtype,
    device: torch.device,
    max_pages_per_seq: int,
    graph_buckets: tuple[int, ...] = (),
) -> PagedLatentAttention:
    """FlashInfer on CUDA for the latent sizes it covers, the torch reference otherwise."""
    if device.type == "cuda" and shape.flashinfer_supported:
        return FlashInferPagedLatentAttention(
            shape, dtype, device, max_pages_per_seq, graph_buckets
        )
    return TorchPagedLatentAttention(shape)
