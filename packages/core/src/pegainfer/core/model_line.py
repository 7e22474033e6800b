"""The contract between core and a model line (one package per model family).

A line claims checkpoints by probing their `config.json`, builds the model (forward pass,
weights, KV arenas) and may bring its own scheduler. Core never imports a line directly: lines
arrive through the plugin manager (`plugins.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pegainfer.core.distributed.parallel import ParallelGroup
from pegainfer.core.text.tokenizer import TOKENIZER_FILE, Tokenizer

if TYPE_CHECKING:
    from pegainfer.core.attention.latent import MultiHeadLatentAttention
    from pegainfer.core.attention.paged import PagedAttention
    from pegainfer.core.engine.scheduler import Scheduler
    from pegainfer.core.kv.kv_cache import ArenaSpec, KVCache, StateSpec
    from pegainfer.core.runner.forward_batch import ForwardBatch
    from pegainfer.core.runner.model_runner import ModelRunner
    from pegainfer.core.speculative.drafter import Drafter


@dataclass(frozen=True)
class Probe:
    """A line's answer to "is this checkpoint yours?"; `reason` explains a refusal."""

    claimed: bool
    reason: str = ""

    @classmethod
    def claim(cls) -> Probe:
        return cls(True)

    @classmethod
    def reject(cls, reason: str) -> Probe:
        return cls(False, reason)


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


@dataclass(frozen=True)
class RuntimeConfig:
    """What the engine decided that shapes a model's per-step machinery."""

    block_size: int
    max_model_len: int
    #: The most tokens and sequences one step carries (the scheduler's budgets).
    max_num_batched_tokens: int
    max_num_seqs: int
    #: Batch sizes decode CUDA graphs are captured for (empty: run eagerly).
    graph_buckets: tuple[int, ...] = ()
    #: `--decode-attention-tensor-cores`: for lines whose `Model.gqa_decode_kernels` is set.
    decode_attention_tensor_cores: str = "auto"

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


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


class ModelLine(ABC):
    """One model family: probe, build, and the policies that family needs."""

    #: Short name, also the extra that installs the line (`pip install pegainfer[<name>]`).
    name: str
    #: Engine arguments this line ignores; setting one is an error rather than a silent no-op.
    unsupported_args: frozenset[str] = frozenset()
    #: Whether a prefix-cache hit restores everything a sequence's model state needs (it does
    #: not for recurrent layers until their states are checkpointed); if not, the engine runs
    #: the line with prefix caching off.
    supports_prefix_caching: bool = True
    #: Whether the model runs data-parallel attention (`ModelContext.data_parallel`): its
    #: forward exchanges tokens with the other ranks where they meet (MoE layers) and returns
    #: every rank's logits rows on rank 0, none elsewhere (`--data-parallel-size`).
    supports_data_parallel: bool = False
    #: The chat answer parsers this family's output needs, by registered name (plugins.py);
    #: the server uses them unless told otherwise.
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    #: The file that makes a directory this line's tokenizer (`--tokenizer` is checked for it).
    tokenizer_file: str = TOKENIZER_FILE

    @abstractmethod
    def probe(self, config: dict[str, Any]) -> Probe:
        """Claim or refuse a checkpoint from its config.json contents. Must be cheap."""

    @abstractmethod
    def build_model(self, ctx: ModelContext) -> Model:
        """Build the model on `ctx.device` and load its weights from `ctx.model_dir`."""

    def reasoning_parser_for(self, config: dict[str, Any], tokenizer_dir: Path) -> str | None:
        """The reasoning parser this checkpoint's answers need, from its config.json contents
        and tokenizer directory: `reasoning_parser`, unless the family's checkpoints differ
        (Kimi-K2-Instruct does not think, Kimi-K2-Thinking does). Must be cheap."""
        return self.reasoning_parser

    def load_tokenizer(self, tokenizer_dir: Path) -> Tokenizer:
        """The tokenizer and chat templates of a checkpoint directory (the model's, or
        `--tokenizer`'s). Core's reads `tokenizer.json`; a line whose checkpoints ship another
        format (Kimi-K2's `tiktoken.model`) builds the same `Tokenizer` from it. Called in every
        process that tokenizes: the server's and, for grammars, the engine's."""
        return Tokenizer.from_dir(tokenizer_dir)

    def build_drafter(
        self, model: Model, ctx: ModelContext, num_tokens: int, runner: ModelRunner
    ) -> Drafter | None:
        """The checkpoint's own drafter for `model` (its MTP layers, loaded from
        `ctx.model_dir`), proposing `num_tokens` tokens per request for speculative decoding
        (`speculative/drafter.py`); None when the line has none. Called before the model's
        arenas are read (the drafter's may join them) and before `runner` allocates them."""
        return None

    def scheduler_class(self) -> type[Scheduler]:
        """The scheduler this family runs under; core's default suits dense attention."""
        from pegainfer.core.engine.scheduler import Scheduler

        return Scheduler

    def write_tiny_checkpoint(
        self, out_dir: Path, *, seed: int = 0, num_shards: int = 1, **overrides: Any
    ) -> None:
        """Write a small random checkpoint in the real layout (for tests and tryouts).

        `overrides` replace config.json fields; `num_shards` > 1 writes a sharded checkpoint.
        """
        raise NotImplementedError(f"model line {self.name!r} has no tiny checkpoint writer")
