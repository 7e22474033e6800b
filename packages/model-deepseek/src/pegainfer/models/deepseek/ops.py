"""DeepSeek-V2's own operations as torch reference ops (the CPU path and the GPU kernels'
yardstick), following transformers' `modeling_deepseek_v2` casts.

- YaRN inverse frequencies and RoPE on interleaved pairs (x0, x1), (x2, x3), ... of the 64
  rotary dims, as transformers' complex multiplication does it, in float32.
- MLA attention over the paged latent cache in the expanded form: each cached token holds
  its normalised latent c [kv_lora_rank] and its roped k_pe [rope dims], shared by all heads;
  K = [W_uk c | k_pe], V = W_uv c per head.
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


def write_latent(latent_layer: torch.Tensor, entry: torch.Tensor, batch: ForwardBatch) -> None:
    """Store this step's [c | k_pe] rows [tokens, dim] at `batch.slot_mapping`; the layer's
    cache is [num_blocks, block_size, dim]."""
    blocks = batch.slot_mapping // batch.block_size
    offsets = batch.slot_mapping % batch.block_size
    latent_layer[blocks, offsets] = entry.to(latent_layer.dtype)


def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent_layer: torch.Tensor,
    kv_b_proj: torch.Tensor,
    batch: ForwardBatch,
    kv_lora_rank: int,
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of q [tokens, heads, nope | rope] over each sequence's cached latents,
    expanded per head by kv_b_proj [heads * (nope + v), kv_lora_rank]; out [tokens, heads, v]."""
    tokens, heads, nope = q_nope.shape
    out = torch.empty(tokens, heads, v_head_dim, dtype=q_nope.dtype, device=q_nope.device)
    bs, start = batch.block_size, 0
    for q_len, seq_len, table in zip(
        batch.query_lens_cpu, batch.seq_lens_cpu, batch.block_tables_cpu, strict=True
    ):
        blocks = torch.tensor(table[: (seq_len + bs - 1) // bs], device=q_nope.device)
        cached = latent_layer[blocks].flatten(0, 1)[:seq_len].to(q_nope.dtype)
        c, k_pe = cached[:, :kv_lora_rank], cached[:, kv_lora_rank:]
        kv = F.linear(c, kv_b_proj).view(seq_len, heads, nope + v_head_dim)
        k_nope, v = kv.split([nope, v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_pe[:, None].expand(-1, heads, -1)), dim=-1)
        rows = slice(start, start + q_len)
        q = torch.cat((q_nope[rows], q_pe[rows]), dim=-1)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale=scale
        )
        out[rows] = attn.transpose(0, 1)
        start += q_len
    return out


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
    gate_up: list[torch.Tensor],
    down: list[torch.Tensor],
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]), expert by expert (SwiGLU)."""
    out = torch.zeros_like(x)
    for expert in experts.unique().tolist():
        token, slot = (experts == expert).nonzero(as_tuple=True)
        gate, up = F.linear(x[token], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out
