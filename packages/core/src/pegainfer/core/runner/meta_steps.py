"""A model's steps run on the meta device, to list the Triton kernels they launch (issue 21).

A line builds its model on the meta device with its CUDA ops (`ModelLine.kernel_plan`), and
`record_step_launches` runs its forward over steps of every size class the engine makes, with
`record_launches` on: each launcher computes its grid, constexprs and strides as it would on a
GPU, and the launch is recorded instead of run. The forward is the model's own, so the list
follows its code; what it cannot run on meta tensors is attention, which a line stands in for
with `MetaAttention` (FlashInfer builds its modules separately: `KernelPlan.attention`).
"""

from __future__ import annotations

from functools import partial

import torch

from pegainfer.core.attention.latent import LatentShape, make_latent_attention
from pegainfer.core.attention.paged import PagedAttention, make_paged_attention
from pegainfer.core.kernels.dispatch import meta_as_cuda
from pegainfer.core.kernels.precompile import KernelLaunch, KernelPlan, StepBounds, record_launches
from pegainfer.core.kv.kv_cache import KVCache
from pegainfer.core.model import Model
from pegainfer.core.runner.forward_batch import ForwardBatch
from pegainfer.core.runner.warmup import specializing_counts

META = torch.device("meta")


class MetaAttention(PagedAttention):
    """Paged attention of meta tensors: the output's shape and dtype, nothing computed (no
    Triton kernel runs inside attention; FlashInfer's modules are `KernelPlan.attention`)."""

    def plan(self, batch: ForwardBatch) -> None:
        pass

    def plan_graph(self, batch: ForwardBatch, bucket: int) -> None:
        pass

    def _attend(self, q: torch.Tensor, kv_layer: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out


class MetaLatentAttention:
    """`MultiHeadLatentAttention` of meta tensors: the output's shape and dtype, nothing
    computed (its forms run FlashInfer and torch, no Triton)."""

    transient_bytes = 0
    split = None

    def __init__(self, shape: LatentShape) -> None:
        self.shape = shape

    def plan(self, batch: ForwardBatch) -> None:
        pass

    def plan_graph(self, batch: ForwardBatch, bucket: int) -> None:
        pass

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, *caches: torch.Tensor) -> torch.Tensor:
        return q_nope.new_empty(*q_nope.shape[:2], self.shape.value_dim)


def meta_steps(
    bounds: StepBounds, recurrent: bool, extra: frozenset[int] = frozenset()
) -> list[ForwardBatch]:
    """Steps on the meta device that together make every size-dependent specialization: a
    prompt of each of `bounds.token_counts(extra)`, a decode batch of each count up to
    `max_num_seqs`, a chunk beside decodes, and for recurrent lines a chunk that restarts from a
    checkpoint and checkpoints mid-way (sequence slots 0.., the checkpoints' after
    `max_num_seqs`)."""
    bs = bounds.block_size

    def batch(starts: list[int], lengths: list[int], **states: object) -> ForwardBatch:
        tables, first = [], 0
        for start, n in zip(starts, lengths, strict=True):
            pages = -(-(start + n) // bs)
            tables.append(list(range(first, first + pages)))
            first += pages
        slots = list(range(len(lengths))) if recurrent else None
        return ForwardBatch.build([[0] * n for n in lengths], starts, tables,
                                  [True] * len(lengths), bs, META, state_slots=slots,
                                  **states)  # fmt: skip

    counts = bounds.token_counts(extra)
    steps = [batch([0], [n]) for n in counts]
    steps += [batch([bs + 3] * n, [1] * n) for n in counts if n <= bounds.max_num_seqs]
    chunk = 17
    if bounds.max_num_seqs > 1 and chunk + 1 <= bounds.max_num_batched_tokens:
        steps.append(batch([bs + 3] * 2, [1, chunk]))
    if recurrent:
        checkpoint = bounds.max_num_seqs
        steps.append(batch([bs], [chunk], state_restore=[checkpoint],
                           state_snapshot=[(5, checkpoint)]))  # fmt: skip
    return steps


def record_step_launches(model: Model, bounds: StepBounds) -> tuple[KernelLaunch, ...]:
    """The Triton launches of `model`'s forward (built on the meta device, with the ops and
    attention its CUDA steps use) over `meta_steps`, each specialization once."""
    specs, states = model.kv_arenas(bounds.block_size), model.state_arenas()
    extra = specializing_counts(model, bounds.max_num_batched_tokens)
    steps = meta_steps(bounds, bool(states), extra)
    pages = max(sum(len(t) for t in step.block_tables_cpu) for step in steps)
    slots = bounds.max_num_seqs + 1 if states else 0
    cache = KVCache(specs, pages, META, states, slots)
    with torch.inference_mode(), meta_as_cuda(), record_launches() as launches:
        for step in steps:
            model.prepare(step)
            model(step, cache)
    return tuple(launches)


def paged_kernel_plan(
    model: Model, dtype: torch.dtype, device: torch.device, bounds: StepBounds
) -> KernelPlan:
    """The plan of a line on `attention.paged` served on `device`, from its model built on the
    meta device (`loading.weights.meta_model`: cheap) with `attention_shape` and
    `set_up_steps(runtime, attn, kernels)` (its step machinery for `kernels`' device type):
    the launches of its forward with `device`'s kernels (recorded when the plan is compiled),
    and its paged attention's FlashInfer modules."""
    shape = model.attention_shape

    def launches() -> tuple[KernelLaunch, ...]:
        model.set_up_steps(bounds.runtime(), MetaAttention(shape), device)
        return record_step_launches(model, bounds)

    attention = partial(make_paged_attention, shape, dtype, device, 1, (),
                        bounds.decode_attention_tensor_cores)  # fmt: skip
    return KernelPlan(launches, attention)


def latent_kernel_plan(
    model: Model, dtype: torch.dtype, device: torch.device, bounds: StepBounds
) -> KernelPlan:
    """`paged_kernel_plan` for a line on core's latent-attention MoE decoder
    (`latent_moe.model`): its model built on the meta device has `latent_shape` and
    `set_up_steps`; the attention is its MLA's FlashInfer modules (the absorbed and the
    expanded form's)."""
    shape = model.latent_shape

    def launches() -> tuple[KernelLaunch, ...]:
        model.set_up_steps(bounds.runtime(), MetaLatentAttention(shape), device)
        return record_step_launches(model, bounds)

    attention = partial(make_latent_attention, shape, dtype, device, bounds.runtime())
    return KernelPlan(launches, attention if shape.flashinfer_supported else None)
