"""The forward-pass side of the model-line contract: what a line's `build_model` receives
(`ModelContext`) and returns (`Model`). Only the engine's processes import it (torch); the
line's probe, tokenizer and parsers live in `model_line.py`, which the HTTP server uses."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pegainfer.core.distributed.parallel import ParallelGroup
from pegainfer.core.model_line import RuntimeConfig

if TYPE_CHECKING:
    from pegainfer.core.attention.latent import MultiHeadLatentAttention
    from pegainfer.core.attention.paged import PagedAttention
    from pegainfer.core.kv.kv_cache import ArenaSpec, KVCache, StateSpec
    from pegainfer.core.runner.forward_batch import ForwardBatch


@dataclass(frozen=True)
class ModelContext:
    """What a line needs to build its model; `parallel` is this process's tensor-parallel
    rank (the default: one process holding every weight); `expert_parallel`: a MoE line
    divides its routed experts between the ranks instead of splitting each one's width;
    `data_parallel`: this process's attention rank when each rank serves its own sequences
    (MoE lines: the routed experts are divided between these ranks, tokens exchanged);
    `random_weights`: the weights are drawn in place, not read from `model_dir`."""

    model_dir: Path
    config: dict[str, Any]
    dtype: torch.dtype
    device: torch.device
    parallel: ParallelGroup = field(default_factory=ParallelGroup)
    expert_parallel: bool = False
    data_parallel: ParallelGroup = field(default_factory=ParallelGroup)
    random_weights: bool = False


class Model(torch.nn.Module, ABC):
    """A model line's forward pass over paged KV.

    The engine calls `init_runtime` once after loading, then for every step `prepare` (or
    `prepare_graph` before a CUDA-graph replay), outside any graph, then `forward`, which
    takes the flat batch of the step and returns the logits of the rows listed in
    `batch.logits_indices`, in float32. `forward` must be capturable for pure-decode
    batches when the model supports graphs (nothing in it may read device values on the host).
    """

    supports_cuda_graphs: bool = False
    #: Whether steps with prefill tokens may replay piecewise graphs
    #: (`runner/piecewise_graphs.py`): `forward` is `logits(hidden_states(batch, kv_cache),
    #: batch)`, and `hidden_states` is capturable for any token count (nothing in it reads
    #: device values on the host or depends on the batch's sequences) except through the calls
    #: of `piecewise_cuts()`, which run eagerly between the pieces.
    supports_piecewise_graphs: bool = False
    #: Whether the line's attention decodes through `attention.paged` (GQA), which honours
    #: `RuntimeConfig.decode_attention_tensor_cores`; the engine refuses a choice otherwise.
    gqa_decode_kernels: bool = False
    #: Whether the line's dense layers honour `RuntimeConfig.small_batch_gemv` (`core.dense`).
    supports_small_batch_gemv: bool = False

    @property
    def transient_bytes(self) -> int:
        """Memory a step may hold beyond what the engine's profiling step shows (e.g. MLA's
        expanded keys and values for a long sequence: the profiling step's are only as long
        as its prompts); the KV cache leaves it free."""
        return 0

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def max_position_embeddings(self) -> int: ...

    @abstractmethod
    def kv_arenas(self, block_size: int) -> list[ArenaSpec]:
        """The cache tensors one KV block needs, for every layer."""

    def state_arenas(self) -> list[StateSpec]:
        """Fixed-size state each running sequence keeps per layer (recurrent layers); a
        sequence whose step starts at position 0 must not read what its slot held before."""
        return []

    def after_loading(self) -> None:
        """Put loaded weights in the form the forward reads (`build_and_load` calls it once,
        before any memory is measured), e.g. MLA's quantized kv_b dequantized for absorption."""

    @abstractmethod
    def init_runtime(self, runtime: RuntimeConfig) -> None:
        """Set up what steps need (attention backends, their graph buffers)."""

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Plan one eager step (attention metadata)."""

    def prepare_graph(self, batch: ForwardBatch, bucket: int) -> None:
        """Plan a pure-decode step padded to `bucket` rows, for a captured graph's replay."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    @abstractmethod
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor: ...

    def hidden_states(self, batch: ForwardBatch, kv_cache: KVCache) -> tuple[torch.Tensor, ...]:
        """Every row's final hidden state, as the tensors `logits` takes (piecewise graphs)."""
        raise NotImplementedError(f"{type(self).__name__} does not support piecewise graphs")

    def logits(self, states: tuple[torch.Tensor, ...], batch: ForwardBatch) -> torch.Tensor:
        """The logits of `batch.logits_indices`' rows from `hidden_states`' output."""
        raise NotImplementedError(f"{type(self).__name__} does not support piecewise graphs")

    def piecewise_cuts(self) -> list[PagedAttention | MultiHeadLatentAttention]:
        """The backends whose calls cut the forward into pieces (each has a `split` hook)."""
        raise NotImplementedError(f"{type(self).__name__} does not support piecewise graphs")
