"""Sizing the KV cache: on a GPU from what a step actually uses, on the CPU from the model.

On a GPU, after the weights are loaded, one worst-case step (a full-budget prefill, and
sampling at the full batch width) runs on a scratch cache; its peak, the recurrent state, the
transient memory the model declares (`Model.transient_bytes`), the weights, a reserve for
CUDA graphs and what the mixed steps' pieces hold (a step's peak again, and the inputs of
their cuts for every token bucket, measured on a short step) come off the memory
`gpu_memory_utilization` allows, and the rest becomes KV blocks.

On the CPU (`cpu_kv_blocks`) the cache is allocated and zeroed up front, so every byte of it
is resident from the start: it gets what the user gives it (`--cpu-kv-cache-gib`) or, by
default, as much memory as the weights take, within bounds.

Once the engine has started, `release_start_up_memory` gives back the host memory that
loading, sizing and warming up used and serving does not.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from pegainfer.core.errors import ConfigError
from pegainfer.core.kv.kv_cache import (
    ArenaSpec,
    KVCache,
    StateSpec,
    blocks_for_memory,
    bytes_per_block,
)
from pegainfer.core.model import Model
from pegainfer.core.process_info import release_freed_memory, rss_bytes
from pegainfer.core.runner.forward_batch import ForwardBatch
from pegainfer.core.runner.piecewise_graphs import held_bytes_per_token
from pegainfer.core.sampling.sampler import SamplingBatch, sample

logger = logging.getLogger(__name__)
GIB = 1 << 30
# CUDA graphs' private pool (decode activations are small) and allocator slack.
_GRAPH_RESERVE = 1 * GIB
# The CPU cache's default bounds (`cpu_kv_blocks`).
CPU_KV_DEFAULT_MIN = 64 << 20
CPU_KV_DEFAULT_MAX = 2 * GIB


@dataclass(frozen=True)
class MemoryPlan:
    total: int
    weights: int
    activations: int
    reserve: int
    kv_cache: int
    num_blocks: int

    def describe(self) -> str:
        return (
            f"GPU memory: {self.total / GIB:.1f} GiB total; weights {self.weights / GIB:.2f} GiB, "
            f"step peak, state and transients {self.activations / GIB:.2f} GiB, graphs and slack "
            f"{self.reserve / GIB:.2f} GiB, KV cache {self.kv_cache / GIB:.2f} GiB "
            f"({self.num_blocks} blocks)"
        )


def profile_step_peak(
    model: Model,
    specs: list[ArenaSpec],
    states: list[StateSpec],
    block_size: int,
    num_tokens: int,
    num_seqs: int,
    max_model_len: int,
    device: torch.device,
) -> int:
    """Bytes the largest step allocates beyond what is resident (weights, buffers).

    The step fills the token budget (which sets the activations) with as many sequences as a
    step may hold, each no longer than `max_model_len`, every one sampling (which sets the
    logits and the sampler's buffers; with data-parallel attention the step's logits are every
    rank's rows, which rank 0 samples).
    """
    seqs = max(min(num_seqs, num_tokens), -(-num_tokens // max_model_len))
    base, extra = divmod(num_tokens, seqs)
    lengths = [base + 1] * extra + [base] * (seqs - extra)
    tables, pages = [], 0
    for length in lengths:
        count = -(-length // block_size)
        tables.append(list(range(pages, pages + count)))
        pages += count
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device)
    scratch = KVCache(specs, pages, device, states, seqs)
    batch = ForwardBatch.build(
        [[0] * n for n in lengths], [0] * seqs, tables, [True] * seqs, block_size, device,
        state_slots=list(range(seqs)),
    )  # fmt: skip
    with torch.inference_mode():
        model.prepare(batch)
        logits = model(batch, scratch)
        # With data-parallel attention rank 0 samples every rank's rows, the others none.
        rows = logits.shape[0]
        probe = SamplingBatch(
            temperature=torch.ones(rows),
            top_k=torch.full((rows,), 20),
            top_p=torch.full((rows,), 0.9),
            min_p=torch.full((rows,), 0.05),
            generators=[torch.Generator(device)] * rows,
            banned=[frozenset()] * rows,
        ).to(device)
        if rows:
            sample(logits, probe)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - resident - scratch.nbytes
    del scratch, batch, logits
    torch.cuda.empty_cache()
    return peak


def pieces_bytes_per_token(
    model: Model, specs: list[ArenaSpec], states: list[StateSpec], block_size: int,
    device: torch.device,
) -> int:  # fmt: skip
    """`held_bytes_per_token` of the model's pieces, on a 16-token prompt over a scratch
    cache."""
    tokens = 16
    pages = -(-tokens // block_size)
    scratch = KVCache(specs, pages, device, states, 1)
    batch = ForwardBatch.build([[0] * tokens], [0], [list(range(pages))], [True], block_size,
                               device, state_slots=[0])  # fmt: skip
    with torch.inference_mode():
        held = held_bytes_per_token(model, batch, scratch)
    del scratch, batch
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return held


def cpu_kv_blocks(
    specs: list[ArenaSpec],
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    weight_bytes: int,
    budget_bytes: int | None = None,
) -> int:
    """KV blocks for a CPU engine: `budget_bytes` of them, or by default as many bytes as the
    weights (a CPU serves as many sequences at once as its compute allows, and that scales with
    the weights), at least `CPU_KV_DEFAULT_MIN` and at most `CPU_KV_DEFAULT_MAX`; never more
    than `max_num_seqs` sequences of `max_model_len` tokens can hold. (A tiny test model gets
    64 MiB, 32k tokens, where a fixed 2 GiB kept its server at 2.3 GB resident.)"""
    if budget_bytes is None:
        budget_bytes = min(max(weight_bytes, CPU_KV_DEFAULT_MIN), CPU_KV_DEFAULT_MAX)
    useful = max_num_seqs * -(-max_model_len // block_size)
    return min(useful, blocks_for_memory(specs, budget_bytes))


def given_gpu_kv_blocks(
    specs: list[ArenaSpec], state_bytes: int, memory_bytes: int, device: torch.device
) -> int:
    """`--kv-cache-memory-bytes` on a GPU: the blocks that fit in `memory_bytes` beside the
    recurrent state, with no profiling step (refused past the memory free now)."""
    free, _ = torch.cuda.mem_get_info(device)
    if memory_bytes > free:
        raise ConfigError(
            f"--kv-cache-memory-bytes {memory_bytes} is more than the {free} bytes free on "
            f"{device} once the weights are loaded"
        )
    num_blocks = blocks_for_memory(specs, memory_bytes - state_bytes)
    if num_blocks < 1:
        raise ConfigError(
            f"--kv-cache-memory-bytes {memory_bytes} leaves no KV block beside the "
            f"{state_bytes} bytes of recurrent state"
        )
    logger.info("KV cache: %.2f GiB as given (no profiling step)", memory_bytes / GIB)
    return num_blocks


@dataclass(frozen=True)
class KVSizing:
    """What the KV cache's size on a GPU depends on besides the model (under tensor
    parallelism rank 0 sends it, and every rank sizes its own shard the same way)."""

    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    gpu_memory_utilization: float
    #: Recurrent-state slots the cache holds beside the blocks.
    num_slots: int
    #: The token buckets of the piecewise graphs of mixed steps captured after the cache is
    #: allocated (none: no pieces). Their private pool holds a step's activations again,
    #: bounded by the step's peak, and every bucket's held inputs (`held_bytes_per_token`).
    mixed_step_tokens: tuple[int, ...] = ()


def fit_kv_blocks(model: Model, sizing: KVSizing, device: torch.device) -> int:
    """The KV blocks that fit beside the model, its recurrent state, its largest step and the
    transient memory it declares."""
    specs, states = model.kv_arenas(sizing.block_size), model.state_arenas()
    state_bytes = sizing.num_slots * sum(spec.bytes_per_slot for spec in states)
    peak = profile_step_peak(
        model, specs, states, sizing.block_size, sizing.max_num_batched_tokens,
        sizing.max_num_seqs, sizing.max_model_len, device,
    )  # fmt: skip
    held = peak + state_bytes + model.transient_bytes
    if sizing.mixed_step_tokens:
        per_token = pieces_bytes_per_token(model, specs, states, sizing.block_size, device)
        held += peak + per_token * sum(sizing.mixed_step_tokens)
    return plan_gpu_kv(specs, sizing.gpu_memory_utilization, held, device).num_blocks


def plan_gpu_kv(
    specs: list[ArenaSpec], utilization: float, step_peak: int, device: torch.device
) -> MemoryPlan:
    free, total = torch.cuda.mem_get_info(device)
    used = total - free  # weights, CUDA context, other processes
    weights = torch.cuda.memory_allocated(device)
    kv_bytes = int(total * utilization) - used - step_peak - _GRAPH_RESERVE
    num_blocks = blocks_for_memory(specs, max(kv_bytes, 0))
    if num_blocks < 1:
        raise ConfigError(
            f"no GPU memory is left for the KV cache at gpu_memory_utilization {utilization}: "
            f"{used / GIB:.1f} GiB in use, a step needs {step_peak / GIB:.1f} GiB more, of "
            f"{total / GIB:.1f} GiB"
        )
    plan = MemoryPlan(
        total, weights, step_peak, _GRAPH_RESERVE, num_blocks * bytes_per_block(specs), num_blocks
    )
    logger.info(plan.describe())
    return plan


def release_start_up_memory(device: torch.device) -> None:
    """Give back what starting the engine left behind: Python garbage, the page-locked host
    blocks torch's caching host allocator kept from the profile step, graph captures and
    warm-up (CUDA; steps allocate the few they need again), and the heap glibc kept from
    reading the checkpoint and building the model."""
    before = rss_bytes()
    gc.collect()
    if device.type == "cuda":
        torch._C._host_emptyCache()  # private, and what torch.cuda.graph calls before a capture
    release_freed_memory()
    logger.info("start-up memory given back: %d MiB resident", (before - rss_bytes()) >> 20)
