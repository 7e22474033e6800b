"""Rotary position embedding, neox style (rotate halves)."""

import torch


class RotaryEmbedding:
    """Precomputed cos/sin for positions `[0, max_positions)`.

    `inv_freq` is computed as transformers computes it, so the tables match its float32
    values exactly; `apply` rotates the first `rotary_dim` features of each head.
    """

    def __init__(
        self, rotary_dim: int, base: float, max_positions: int, device: torch.device
    ) -> None:
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float) / rotary_dim
        inv_freq = 1.0 / (base**exponent)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.rotary_dim = rotary_dim
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate `x` [tokens, heads, head_dim] at `positions` [tokens]."""
        cos = self.cos[positions].to(x.dtype).unsqueeze(1)
        sin = self.sin[positions].to(x.dtype).unsqueeze(1)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
        return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)
