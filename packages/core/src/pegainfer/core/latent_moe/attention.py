"""The MLA layer of a latent-attention decoder: the q projection (direct, or a q LoRA through
`q_a_proj`, its norm and `q_b_proj`) and `kv_a_proj_with_mqa` fused in one GEMM, the latent's
norm and the rope rotation written to the cache (`latent_input`: one Triton kernel on CUDA),
attention in core's absorbed or expanded form (`core.attention.latent`, given `kv_b_proj` per
head), then `o_proj`. Under tensor parallelism a rank holds its share of the heads. A quantized
checkpoint's projections are `QuantLinear`s (`core.quant`), but for `kv_b_proj`, which MLA
reads per head (folded into queries and outputs) and which is dequantized once after loading."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pegainfer.core.attention.latent import MultiHeadLatentAttention
from pegainfer.core.distributed import parallel
from pegainfer.core.kernels.dispatch import uses_cuda_kernels
from pegainfer.core.latent_moe.config import LatentMoEConfig
from pegainfer.core.loading.weights import empty_param
from pegainfer.core.ops.interleaved_rope import InterleavedRope
from pegainfer.core.ops.latent_input import latent_input as latent_input_reference
from pegainfer.core.ops.rms_norm import rms_norm
from pegainfer.core.quant.linear import QuantLinear, linear, linear_weight
from pegainfer.core.quant.scheme import QuantScheme
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
    def __init__(
        self,
        cfg: LatentMoEConfig,
        group: parallel.ParallelGroup,
        scheme: QuantScheme | None = None,
        layer: str = "model.layers.0",
    ) -> None:
        """`scheme`: how the checkpoint stores the projections of `layer` (its checkpoint
        name)."""
        super().__init__()
        self.cfg = cfg
        self.group = group
        heads, h = cfg.num_heads, cfg.hidden_size

        def fmt(*modules: str):
            names = [f"{layer}.self_attn.{module}" for module in modules]
            return scheme.common_format(names) if scheme is not None else None

        # The two projections of the layer input, one GEMM: q_proj's rows (q_a_proj's with
        # a q LoRA), then kv_a_proj_with_mqa's.
        self.q_rows = heads * cfg.qk_head_dim if cfg.q_lora_rank is None else cfg.q_lora_rank
        q_a = "q_proj" if cfg.q_lora_rank is None else "q_a_proj"
        self.q_kv_a_proj = linear_weight(self.q_rows + cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                         h, fmt(q_a, "kv_a_proj_with_mqa"))  # fmt: skip
        if cfg.q_lora_rank is not None:
            self.q_a_layernorm = empty_param(cfg.q_lora_rank)
            self.q_b_proj = linear_weight(heads * cfg.qk_head_dim, cfg.q_lora_rank,
                                          fmt("q_b_proj"))  # fmt: skip
        self.kv_a_layernorm = empty_param(cfg.kv_lora_rank)
        self.kv_b_proj = linear_weight(heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                       cfg.kv_lora_rank, fmt("kv_b_proj"))  # fmt: skip
        self.o_proj = linear_weight(h, heads * cfg.v_head_dim, fmt("o_proj"))

    def after_loading(self) -> None:
        """A quantized kv_b_proj, dequantized once to the model's dtype: attention reads it
        per head (absorbed into queries and outputs, or expanding cached latents)."""
        if isinstance(self.kv_b_proj, QuantLinear):
            dense = self.kv_b_proj.dequantize(self.kv_a_layernorm.dtype)
            self.kv_b_proj = nn.Parameter(dense, requires_grad=False)

    @property
    def kv_b(self) -> torch.Tensor:
        """kv_b_proj per head: [heads, nope + value, latent]."""
        cfg = self.cfg
        assert isinstance(self.kv_b_proj, torch.Tensor), "after_loading() dequantizes kv_b"
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
        q_kv_a = linear(x, self.q_kv_a_proj)
        q, kv_a = q_kv_a.split([self.q_rows, q_kv_a.shape[-1] - self.q_rows], dim=-1)
        q_lora = None
        if cfg.q_lora_rank is not None:
            q_lora = rms_norm(q, self.q_a_layernorm, LATENT_NORM_EPS)
            q = linear(q_lora, self.q_b_proj)
        if uses_cuda_kernels(x):
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
