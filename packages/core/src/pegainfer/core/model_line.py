"""The contract between core and a model line (one package per model family).

A line claims checkpoints by probing their `config.json`, builds the model (forward pass,
weights, KV arenas: `model.py`) and may bring its own scheduler. Core never imports a line
directly: lines arrive through the plugin manager (`plugins.py`).

This module and a line's `ModelLine` subclass import no torch: the HTTP server finds the line
of a checkpoint, its tokenizer and its answer parsers through them, and that process stays
torch-free (a line imports its model, kernels and loaders inside `build_model`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pegainfer.core.text.tokenizer import TOKENIZER_FILE, Tokenizer

if TYPE_CHECKING:
    from pegainfer.core.engine.scheduler import Scheduler
    from pegainfer.core.kernels.precompile import KernelPlan, StepBounds
    from pegainfer.core.model import Model, ModelContext
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
    #: `--small-batch-gemv`: for lines whose `Model.supports_small_batch_gemv` is set.
    small_batch_gemv: bool = False

    @property
    def max_pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


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

    def kernel_plan(self, ctx: ModelContext, bounds: StepBounds) -> KernelPlan:
        """What the steps of `ctx`'s model within `bounds` compile on CUDA: its Triton launches
        (`record_launches` over its launchers on meta tensors) and its attention backend's
        factory (`core/kernels/precompile.py`). The engine compiles them while the weights
        load; a GPU test checks that the steps launch nothing else. Must not read weights."""
        from pegainfer.core.kernels.precompile import KernelPlan

        return KernelPlan()

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
