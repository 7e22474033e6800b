"""Compiling what served steps need before the server says it is ready (issue 21).

Triton compiles a kernel once per specialization: per integer argument, whether it equals 1 or
is divisible by 16, and the constexprs a launcher derives from the step's size (the fused
MoE's dispatch sizes its sort to the next power of two of the step's (token, expert) pairs).
FlashInfer builds a module on its first use. A step of a shape never run before waits on the
compiler: on a fresh machine the first load of a Qwen3.5-4B server ran at 256 output tok/s
with a 32 s TTFT p99, against 1,440 tok/s once compiled.

Decode graphs compile their buckets when they are captured. `warm_up` runs the eager steps the
scheduler can produce: a prompt of every token count of `warmup_token_counts` (each power of
two and one past it, up to the step's budget: both sides of every 16-divisibility and
power-of-two boundary, and the counts a module whose kernels specialize on more asks for:
`SpecializesOnSteps`, e.g. the fused MoE's), decodes beside a chunk that continues a cached
prefix and, for recurrent lines, a chunk that restarts from a checkpoint and checkpoints
mid-chunk. With warm kernel caches each step costs what its forward does.

The forwards run on the engine's cache, writing only blocks and state slots a later sequence
overwrites before reading (its prefill writes its blocks; its state starts from zero or a
checkpoint written for it), as the load-time forward check does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from pegainfer.core.runner.forward_batch import ForwardBatch
from pegainfer.core.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@runtime_checkable
class SpecializesOnSteps(Protocol):
    """A module whose kernels specialize on the step's token count in ways the powers of two
    do not cover."""

    def warmup_token_counts(self, max_tokens: int) -> frozenset[int]:
        """Token counts, at most `max_tokens`, whose steps make every specialization."""


@dataclass(frozen=True)
class WarmupShape:
    """What bounds the steps the scheduler makes."""

    block_size: int
    max_num_batched_tokens: int
    max_model_len: int
    max_num_seqs: int
    num_blocks: int
    #: Recurrent lines: their sequences' state slots are 0 .. max_num_seqs - 1 and the
    #: checkpoints' from max_num_seqs on (`num_checkpoints` of them).
    recurrent: bool = False
    num_checkpoints: int = 0
    #: Decode-graph buckets, already run when the graphs were captured.
    graph_buckets: tuple[int, ...] = ()


def warmup_token_counts(
    budget: int, max_model_len: int, extra: frozenset[int] = frozenset()
) -> list[int]:
    """1, then each power of two 2^k and 2^k + 1 up to the step's token budget (a prompt no
    longer than max_model_len), the budget itself, and the `extra` counts within it."""
    limit = min(budget, max_model_len)
    counts = {1, limit} | {n for n in extra if n <= limit}
    power = 2
    while power <= limit:
        counts |= {power, min(power + 1, limit)}
        power *= 2
    return sorted(counts)


def specializing_counts(model: torch.nn.Module, limit: int) -> frozenset[int]:
    """The counts, at most `limit`, the model's `SpecializesOnSteps` modules ask for."""
    return frozenset().union(*(m.warmup_token_counts(limit) for m in model.modules()
                               if isinstance(m, SpecializesOnSteps)))  # fmt: skip


def module_token_counts(model: torch.nn.Module, shape: WarmupShape) -> frozenset[int]:
    """The counts the model's `SpecializesOnSteps` modules ask for, less the decode-graph
    buckets (capture ran steps of those sizes)."""
    limit = min(shape.max_num_batched_tokens, shape.max_model_len)
    return specializing_counts(model, limit) - set(shape.graph_buckets)


def warmup_batches(
    shape: WarmupShape, device: torch.device, extra: frozenset[int] = frozenset()
) -> Iterator[ForwardBatch]:
    """The warm-up's steps (prompts of `warmup_token_counts`, with `extra`), each over the
    first blocks of the cache."""
    bs = shape.block_size

    def batch(starts: list[int], chunks: list[int], **states) -> ForwardBatch:
        tables, first = [], 0
        for start, n in zip(starts, chunks, strict=True):
            pages = -(-(start + n) // bs)
            tables.append(list(range(first, first + pages)))
            first += pages
        slots = list(range(len(chunks))) if shape.recurrent else None
        return ForwardBatch.build([[0] * n for n in chunks], starts, tables,
                                  [True] * len(chunks), bs, device, state_slots=slots,
                                  **states)  # fmt: skip

    for n in warmup_token_counts(shape.max_num_batched_tokens, shape.max_model_len, extra):
        if -(-n // bs) <= shape.num_blocks:
            yield batch([0], [n])
    # A chunk of 17 tokens after a cached prefix of a block and 3 tokens, beside decodes.
    prefix, chunk = bs + 3, 17
    for decodes in (1, 3):
        rows = decodes + 1
        if rows > shape.max_num_seqs or prefix + chunk > shape.max_model_len:
            continue
        if (decodes * -(-(prefix + 1) // bs) + -(-(prefix + chunk) // bs)) > shape.num_blocks:
            continue
        yield batch([prefix] * rows, [1] * decodes + [chunk])
    if shape.recurrent and shape.num_checkpoints and bs + chunk <= shape.max_model_len:
        # A prefix hit: the state restarts from a checkpoint after a block, and is checkpointed
        # again 5 tokens into the chunk (into the next checkpoint slot, if there is one).
        first = shape.max_num_seqs
        second = first + min(1, shape.num_checkpoints - 1)
        yield batch([bs], [chunk], state_restore=[first], state_snapshot=[(5, second)])


def warm_up(runner: ModelRunner, shape: WarmupShape) -> int:
    """Run the warm-up's steps (after the cache is allocated and graphs captured); return how
    many ran."""
    steps = 0
    extra = module_token_counts(runner.model, shape)
    with torch.inference_mode():
        for batch in warmup_batches(shape, runner.device, extra):
            runner.forward(batch, capture=False)  # a lazy graph's capture compiles its own
            steps += 1
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return steps


def _log_late_specialization(**kwargs: Any) -> bool:
    name = getattr(kwargs.get("fn"), "name", "?")
    logger.warning("Triton kernel %s specialized while serving (%s): a step waited on the "
                   "compiler; the warm-up does not cover it", name,
                   str(kwargs.get("repr"))[:400])  # fmt: skip
    return False  # go on and make it


def watch_late_compiles() -> None:
    """From now on, log every Triton specialization this process makes: once the engine is
    ready, each is a served step that waited on the compiler (seconds on a cold cache)
    because the warm-up did not make it.

    Triton calls its `jit_cache_hook` once per specialization a process makes (compiled, or
    loaded from the disk cache), so served steps pay nothing for the watch. A hook someone
    else installed is left alone.
    """
    try:
        from triton import knobs
    except ImportError:
        return
    if getattr(knobs.runtime, "jit_cache_hook", _log_late_specialization) is None:
        knobs.runtime.jit_cache_hook = _log_late_specialization
