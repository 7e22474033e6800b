"""DeepSeek-V2's own operations as torch reference ops (the CPU path and the GPU kernels'
yardstick), following transformers' `modeling_deepseek_v2` casts.

- YaRN inverse frequencies and RoPE on interleaved pairs (x0, x1), (x2, x3), ... of the 64
  rotary dims, as transformers' complex multiplication does it, in float32.
- Writing a step's latents: each cached token holds its normalised latent c [kv_lora_rank]
  (the `ckv` arena) and its roped k_pe [rope dims] (the `kpe` arena), shared by all heads
  (attention over them is core's, `core.latent_attention`).
- Softmax top-k routing without renormalisation, and the experts' SwiGLU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pegainfer.core.forward_batch import ForwardBatch
from pegainfer.models.deepseek.config import Rope


def inv_freq(rope: Rope) -> torch.Tensor:
    """transformers' default or YaRN inverse frequencies for `rope.dim` rotary dims."""
    dim = rope.dim
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if not rope.yarn:
        return 1.0 / pos_freqs

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_positions / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * (
        extrapolation
    )


class InterleavedRope:
    """cos/sin tables for positions [0, max_positions), scaled by YaRN's attention factor."""

    def __init__(self, rope: Rope, max_positions: int, device: torch.device) -> None:
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq(rope))
        self.cos = (freqs.cos() * rope.attention_factor).to(device)
        self.sin = (freqs.sin() * rope.attention_factor).to(device)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate pairs (x[2i], x[2i+1]) of x [tokens, heads, dim] by position, in float32."""
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        pairs = x.float().unflatten(-1, (-1, 2))
        even, odd = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return rotated.flatten(-2).to(x.dtype)


def write_latent(
    ckv_layer: torch.Tensor, kpe_layer: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor,
    batch: ForwardBatch,
) -> None:  # fmt: skip
    """Store this step's latents c [tokens, rank] and roped keys k_pe [tokens, rope] at
    `batch.slot_mapping`; a layer's caches are [num_blocks, block_size, dim]."""
    blocks = batch.slot_mapping // batch.block_size
    offsets = batch.slot_mapping % batch.block_size
    ckv_layer[blocks, offsets] = c.to(ckv_layer.dtype)
    kpe_layer[blocks, offsets] = k_pe.to(kpe_layer.dtype)


def route(
    x: torch.Tensor,
    gate: torch.Tensor,
    top_k: int,
    method: str,
    n_group: int,
    topk_group: int,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over every expert's router logit (float32), the top k by score (greedy, or
    within the best `topk_group` groups), weights = raw probabilities x scaling (never
    renormalised, as DeepSeek-V2 does). Returns (weights [T, k] float32, experts [T, k])."""
    scores = F.linear(x.float(), gate.float()).softmax(dim=-1)
    if method == "group_limited_greedy":
        grouped = scores.view(scores.shape[0], n_group, -1)
        best = grouped.max(dim=-1).values.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(grouped[..., 0]).scatter_(1, best, 1.0).bool()
        scores = scores.masked_fill(~keep[..., None].expand_as(grouped).flatten(1), 0.0)
    weights, experts = scores.topk(top_k, dim=-1, sorted=False)
    return weights * scaling, experts


def moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    first: int = 0,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]), expert by expert (SwiGLU), over the
    experts held here: `gate_up[i]` [2I, H] and `down[i]` [H, I] are expert `first + i`'s
    (expert parallelism holds a range; the others' terms come from other ranks)."""
    out = torch.zeros_like(x)
    for expert in experts.unique().tolist():
        local = expert - first
        if not 0 <= local < gate_up.shape[0]:
            continue
        token, slot = (experts == expert).nonzero(as_tuple=True)
        gate, up = F.linear(x[token], gate_up[local]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[local]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out
