"""MLA's attention input (the torch reference; CUDA: `core.kernels.latent_input`).

Each cached token holds its normalised latent c [kv_lora_rank] (the `ckv` arena) and its roped
k_pe [rope dims] (the `kpe` arena), shared by all heads (attention over them is
`core.attention.latent`); the queries' rope part is rotated alike.
"""

from __future__ import annotations

import torch

from pegainfer.core.ops.interleaved_rope import rotate_interleaved
from pegainfer.core.ops.rms_norm import rms_norm


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
