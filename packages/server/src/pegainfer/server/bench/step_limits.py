"""What one engine step must read and compute, for the physical limits `benchmarks/model_step.py`
sets beside its timings: the routed experts a batch touches, the KV a decode step reads and the
FLOPs of causal attention over a prompt (the weight elements the matmuls see are counted by
`pegainfer.core.matmul_weights`).

Counts are of what the step needs, not of what a kernel happens to do: a packed INT4 int32 holds
eight weights and scales hold none; a batch reads only the routed experts its tokens choose;
sparse attention (GLM-5's) reads the latents of the keys it selects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from pegainfer.core.kv.kv_cache import ArenaSpec
from pegainfer.core.moe.layer import MoE

if TYPE_CHECKING:
    from pegainfer.core.engine.core import EngineCore

# The KV arena of a sparse-attention model's indexer keys (GLM-5's).
INDEX_ARENA = "index_k"


def measured_expert_spread(engine: EngineCore) -> float | None:
    """The fraction of each MoE layer's routed experts that the tokens of the engine's next
    step choose, averaged over the layers: the step run eagerly (its CUDA graphs set aside for
    it) with each layer's routing recorded. How evenly the weights route, beside
    `untouched_experts`' assumption; None for a model without routed experts or with parallel
    ranks (whose steps every rank must run alike)."""
    runner = engine.runner
    moes = [m for m in engine.model.modules() if isinstance(m, MoE)]
    if not moes or engine.ranks is not None or runner is None:
        return None
    chosen: list[tuple[MoE, torch.Tensor]] = []

    def recording(moe: MoE) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        route = moe.route

        def record(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            weights, experts = route(x)
            chosen.append((moe, experts))
            return weights, experts

        return record

    graphs = runner.graphs, runner.mixed_graphs
    runner.graphs = runner.mixed_graphs = None
    for moe in moes:
        moe.route = recording(moe)  # an instance attribute over the method
    try:
        engine.step()
    finally:
        runner.graphs, runner.mixed_graphs = graphs
        for moe in moes:
            del moe.route
    if not chosen:
        return None
    spread = [experts.unique().numel() / moe.experts.count for moe, experts in chosen]
    return sum(spread) / len(spread)


def untouched_experts(experts: int, top_k: int, tokens: int) -> float:
    """The expected fraction of `experts` routed experts that none of `tokens` tokens chooses,
    each choosing `top_k` of them evenly: (1 - k/E)^B (at one token, all but k of E)."""
    return (1 - top_k / experts) ** tokens


def kv_read_bytes(
    arenas: list[ArenaSpec], block_size: int, context: float, top_k: int | None
) -> float:
    """Bytes of KV one sequence's decode step reads at `context` tokens: every arena's, or with
    sparse attention (`top_k`: the keys a row selects) the latents of at most `top_k` keys and,
    once the sequence is longer than that, every one of its indexer keys, to score them."""
    total = 0.0
    for spec in arenas:
        per_token = spec.bytes_per_block / block_size
        if top_k is None:
            total += context * per_token
        elif spec.name == INDEX_ARENA:
            total += context * per_token if context > top_k else 0.0
        else:
            total += min(context, top_k) * per_token
    return total


def attention_flops(cfg: Any, arenas: list[ArenaSpec], tokens: int) -> float:
    """FLOPs of causal attention over a prompt of `tokens` from position 0, for the model
    config `cfg` (a GQA line's `head_dim`, or MLA's head dims; with `index_topk`, sparse).

    GQA: QK and PV over `head_dim`. MLA runs such a prompt expanded: QK over the nope + rope
    dims, PV over `v_head_dim`. A sparse model's sequence longer than `index_topk` keys: the
    indexer scores every earlier key (its heads x head dim) and each row attends, absorbed (QK
    over the latent and rope key, PV over the latent), over at most `index_topk` keys; a shorter
    one attends densely, unscored."""
    layers = arenas[0].num_layers
    top_k = getattr(cfg, "index_topk", None)
    if top_k is not None and tokens > top_k:
        index_layers = next(spec.num_layers for spec in arenas if spec.name == INDEX_ARENA)
        pairs = tokens * (tokens + 1) / 2
        scores = index_layers * 2 * cfg.index_heads * cfg.index_head_dim * pairs
        keys = top_k * (top_k + 1) / 2 + (tokens - top_k) * top_k  # rows' min(i + 1, top_k)
        width = 2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim
        return scores + layers * 2 * cfg.num_heads * width * keys
    head_width = getattr(cfg, "head_dim", None) or (
        cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) / 2  # fmt: skip
    # QK and PV, each 2 FLOPs per multiply-add over half the square (causal).
    return 2 * layers * cfg.num_heads * head_width * tokens * tokens
