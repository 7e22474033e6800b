"""GLM-5's lightning indexer's projections (transformers' `GlmMoeDsaIndexer`): per token its
queries from the q LoRA, its key (LayerNorm with bias, then stored in the layer's indexer-key
arena) and its head weights. Both query and key rotate their first `qk_rope_head_dim` dims on
interleaved pairs (the rest pass through), with the model's RoPE tables. Scoring and top-k are
core's (`core.attention.sparse`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer.core.loading.weights import empty_param
from pegainfer.core.ops.interleaved_rope import InterleavedRope, rotate_interleaved
from pegainfer.core.quant.linear import linear, linear_weight
from pegainfer.core.quant.scheme import QuantScheme, WeightFormat
from pegainfer.core.runner.forward_batch import ForwardBatch
from pegainfer.models.glm5.config import Glm5Config

# transformers builds the key's LayerNorm with eps 1e-6.
KEY_NORM_EPS = 1e-6


def _rotate_front(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, dim] with its first 2 * cos.shape[-1] dims rotated."""
    rotary = 2 * cos.shape[-1]
    return torch.cat((rotate_interleaved(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)


class Indexer(nn.Module):
    def __init__(self, cfg: Glm5Config, scheme: QuantScheme | None, name: str) -> None:
        """`scheme`: how the checkpoint stores the projections of the indexer `name` (its
        checkpoint name). The head weights are never quantized: transformers and vLLM build
        them unquantized, and transformers keeps them in float32 (and runs them so)."""
        super().__init__()
        self.heads, self.dim = cfg.index_heads, cfg.index_head_dim

        def fmt(module: str) -> WeightFormat | None:
            return None if scheme is None else scheme.format_for(f"{name}.{module}")

        self.wq_b = linear_weight(self.heads * self.dim, cfg.q_lora_rank, fmt("wq_b"))
        self.wk = linear_weight(self.dim, cfg.hidden_size, fmt("wk"))
        self.k_norm_weight = empty_param(self.dim)
        self.k_norm_bias = empty_param(self.dim)
        self.weights_proj = empty_param(self.heads, cfg.hidden_size, dtype=torch.float32)

    def forward(
        self,
        x: torch.Tensor,
        q_lora: torch.Tensor,
        batch: ForwardBatch,
        rope: InterleavedRope,
        k_layer: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries [tokens, heads, dim] and head weights [tokens, heads] (float32, with the
        heads^-0.5 factor) of the layer input x and the normalised q LoRA; writes the tokens'
        keys into k_layer [blocks, block_size, dim] at their slots."""
        tokens = x.shape[0]
        cos, sin = rope.cos[batch.positions], rope.sin[batch.positions]
        q = _rotate_front(linear(q_lora, self.wq_b).view(tokens, self.heads, self.dim), cos, sin)
        k = F.layer_norm(linear(x, self.wk), (self.dim,), self.k_norm_weight, self.k_norm_bias,
                         KEY_NORM_EPS)  # fmt: skip
        k = _rotate_front(k[:, None], cos, sin)[:, 0]
        k_layer.view(-1, self.dim)[batch.slot_mapping] = k.to(k_layer.dtype)
        weights = F.linear(x.float(), self.weights_proj) * self.heads**-0.5
        return q, weights
