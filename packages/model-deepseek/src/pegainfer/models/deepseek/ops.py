"""DeepSeek-V2's own operations as torch reference ops (the CPU path and the GPU kernels'
yardstick), following transformers' `modeling_deepseek_v2` casts.

- YaRN inverse frequencies and RoPE on interleaved pairs (x0, x1), (x2, x3), ... of the 64
  rotary dims, as transformers' complex multiplication does it, in float32.
- MLA's attention input: each cached token holds its normalised latent c [kv_lora_rank]
  (the `ckv` arena) and its roped k_pe [rope dims] (the `kpe` arena), shared by all heads
  (attention over them is core's, `core.latent_attention`); the queries' rope part is
  rotated alike (the fused CUDA kernel: `latent_kernels`).
- Softmax top-k routing without renormalisation, and the experts' SwiGLU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pegainfer.core.ops.rms_norm import rms_norm
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
    """cos/sin tables [max_positions, dim / 2] (float32), scaled by YaRN's attention factor."""

    def __init__(self, rope: Rope, max_positions: int, device: torch.device) -> None:
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq(rope))
        self.cos = (freqs.cos() * rope.attention_factor).to(device)
        self.sin = (freqs.sin() * rope.attention_factor).to(device)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [tokens, heads, dim] by cos/sin [tokens, dim / 2],
    in float32."""
    cos, sin = cos[:, None], sin[:, None]
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


def latent_input(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    ckv_layer: torch.Tensor,
    kpe_layer: torch.Tensor,
    num_heads: int,
    nope_dim: int,
    eps: float,
) -> torch.Tensor:
    """Normalise the latents c of kv_a [tokens, latent | rope] and rotate its shared keys,
    store both at `slot_mapping` in one layer's arenas ([num_blocks, block_size, dim]), and
    return the rotated rope part of q [tokens, heads * (nope + rope)]: [tokens, heads, rope]."""
    tokens, half = q.shape[0], cos.shape[1]
    cos, sin = cos[positions], sin[positions]
    q_pe = rotate_interleaved(q.view(tokens, num_heads, -1)[..., nope_dim:], cos, sin)
    c, k_pe = kv_a.split([kv_a.shape[1] - 2 * half, 2 * half], dim=-1)
    blocks, offsets = slot_mapping // ckv_layer.shape[1], slot_mapping % ckv_layer.shape[1]
    ckv_layer[blocks, offsets] = rms_norm(c, norm, eps).to(ckv_layer.dtype)
    kpe_layer[blocks, offsets] = rotate_interleaved(k_pe[:, None], cos, sin)[:, 0]
    return q_pe


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
