"""The MLA layer of a latent-attention decoder: the q projection (direct, or a q LoRA through
`q_a_proj`, its norm and `q_b_proj`) and `kv_a_proj_with_mqa` fused in one GEMM, the latent's
norm and the rope rotation written to the cache (`latent_input`: one Triton kernel on CUDA),
attention in core's absorbed or expanded form (`core.attention.latent`, given `kv_b_proj` per
head), then `o_proj`. Under tensor parallelism a rank holds its share of the heads."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer.core.attention.latent import MultiHeadLatentAttention
from pegainfer.core.distributed import parallel
from pegainfer.core.latent_moe.config import LatentMoEConfig
from pegainfer.core.loading.weights import empty_param
from pegainfer.core.ops.interleaved_rope import InterleavedRope
from pegainfer.core.ops.latent_input import latent_input as latent_input_reference
from pegainfer.core.ops.rms_norm import rms_norm
from pegainfer.core.runner.forward_batch import ForwardBatch

# transformers builds kv_a_layernorm (and q_a_layernorm) with its RMSNorm's default eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class LatentQueries:
    """A step's queries: the normalised q-LoRA output (None without a q LoRA; GLM-5's indexer
    reads it), each head's nope part [tokens, heads, nope] and roped part [tokens, heads,
    rope]."""

    q_lora: torch.Tensor | None
    q_nope: torch.Tensor
    q_pe: torch.Tensor


class LatentAttention(nn.Module):
    def __init__(self, cfg: LatentMoEConfig, group: parallel.ParallelGroup) -> None:
        super().__init__()
        self.cfg = cfg
        self.group = group
        heads, h = cfg.num_heads, cfg.hidden_size
        # The two projections of the layer input, one GEMM: q_proj's rows (q_a_proj's with
        # a q LoRA), then kv_a_proj_with_mqa's.
        self.q_rows = heads * cfg.qk_head_dim if cfg.q_lora_rank is None else cfg.q_lora_rank
        self.q_kv_a_proj = empty_param(self.q_rows + cfg.kv_lora_rank + cfg.qk_rope_head_dim, h)
        if cfg.q_lora_rank is not None:
            self.q_a_layernorm = empty_param(cfg.q_lora_rank)
            self.q_b_proj = empty_param(heads * cfg.qk_head_dim, cfg.q_lora_rank)
        self.kv_a_layernorm = empty_param(cfg.kv_lora_rank)
        self.kv_b_proj = empty_param(
            heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank
        )
        self.o_proj = empty_param(h, heads * cfg.v_head_dim)

    @property
    def kv_b(self) -> torch.Tensor:
        """kv_b_proj per head: [heads, nope + value, latent]."""
        cfg = self.cfg
        return self.kv_b_proj.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)

    def queries(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        ckv: torch.Tensor,
        kpe: torch.Tensor,
        rope: InterleavedRope,
    ) -> LatentQueries:
        """The step's queries from the layer input x [tokens, hidden]; writes the step's
        normalised latents and roped shared keys into the layer's caches."""
        cfg, tokens = self.cfg, x.shape[0]
        q, kv_a = F.linear(x, self.q_kv_a_proj).split(
            [self.q_rows, self.q_kv_a_proj.shape[0] - self.q_rows], dim=-1
        )
        q_lora = None
        if cfg.q_lora_rank is not None:
            q_lora = rms_norm(q, self.q_a_layernorm, LATENT_NORM_EPS)
            q = F.linear(q_lora, self.q_b_proj)
        if x.is_cuda:
            from pegainfer.core.kernels.latent_input import latent_input
        else:
            latent_input = latent_input_reference
        q_pe = latent_input(
            q, kv_a, self.kv_a_layernorm, rope.cos, rope.sin, batch.positions,
            batch.slot_mapping, ckv, kpe, cfg.num_heads, cfg.qk_nope_head_dim, LATENT_NORM_EPS,
        )  # fmt: skip
        q_nope = q.view(tokens, cfg.num_heads, -1)[..., : cfg.qk_nope_head_dim]
        return LatentQueries(q_lora, q_nope, q_pe)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """o_proj of attention's output [tokens, heads, value] (summed over the ranks)."""
        return parallel.row_parallel_linear(out.reshape(out.shape[0], -1), self.o_proj,
                                            self.group)  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        ckv: torch.Tensor,
        kpe: torch.Tensor,
        rope: InterleavedRope,
        attn: MultiHeadLatentAttention,
    ) -> torch.Tensor:
        q = self.queries(x, batch, ckv, kpe, rope)
        return self.output(attn.run(q.q_nope, q.q_pe, ckv, kpe, self.kv_b))
