"""DeepSeek-V2's forward pass over a paged latent cache: MLA attention, then a dense MLP
(the first `first_k_dense_replace` layers) or routed plus shared experts.

The torch reference path, following transformers' `DeepseekV2ForCausalLM` op for op: each
cached token holds its normalised KV latent (the `ckv` arena, `kv_lora_rank` values per layer)
and its roped shared key (`kpe`, `qk_rope_head_dim`), the layout FlashInfer's MLA kernels read;
prefill expands them per head, decode absorbs the up-projections instead
(`ops.mla_attention`). Experts keep their own fused gate/up matrices, as checkpoints store them
per expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer.core.forward_batch import ForwardBatch
from pegainfer.core.kv_cache import ArenaSpec, KVCache
from pegainfer.core.model_line import Model, RuntimeConfig
from pegainfer.core.ops import activation, rms_norm
from pegainfer.core.weights import WeightTarget
from pegainfer.models.deepseek import ops
from pegainfer.models.deepseek.config import DeepseekConfig

# transformers builds kv_a_layernorm (and q_a_layernorm) with its RMSNorm's default eps.
_LATENT_NORM_EPS = 1e-6


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LatentAttention(nn.Module):
    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__()
        self.cfg = cfg
        heads, h = cfg.num_heads, cfg.hidden_size
        if cfg.q_lora_rank is None:
            self.q_proj = _param(heads * cfg.qk_head_dim, h)
        else:
            self.q_a_proj = _param(cfg.q_lora_rank, h)
            self.q_a_layernorm = _param(cfg.q_lora_rank)
            self.q_b_proj = _param(heads * cfg.qk_head_dim, cfg.q_lora_rank)
        self.kv_a_proj_with_mqa = _param(cfg.kv_lora_rank + cfg.qk_rope_head_dim, h)
        self.kv_a_layernorm = _param(cfg.kv_lora_rank)
        self.kv_b_proj = _param(heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        self.o_proj = _param(h, heads * cfg.v_head_dim)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        ckv: torch.Tensor,
        kpe: torch.Tensor,
        rope: ops.InterleavedRope,
    ) -> torch.Tensor:
        cfg, tokens = self.cfg, x.shape[0]
        if cfg.q_lora_rank is None:
            q = F.linear(x, self.q_proj)
        else:
            q_a = rms_norm.rms_norm(
                F.linear(x, self.q_a_proj), self.q_a_layernorm, _LATENT_NORM_EPS
            )
            q = F.linear(q_a, self.q_b_proj)
        q_nope, q_pe = q.view(tokens, cfg.num_heads, -1).split(
            [cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1
        )
        c, k_pe = F.linear(x, self.kv_a_proj_with_mqa).split(
            [cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1
        )
        c = rms_norm.rms_norm(c, self.kv_a_layernorm, _LATENT_NORM_EPS)
        q_pe = rope.apply(q_pe, batch.positions)
        k_pe = rope.apply(k_pe[:, None], batch.positions)[:, 0]
        ops.write_latent(ckv, kpe, c, k_pe, batch)
        out = ops.mla_attention(
            q_nope, q_pe, ckv, kpe, self.kv_b_proj, batch, cfg.v_head_dim, cfg.softmax_scale
        )
        return F.linear(out.reshape(tokens, -1), self.o_proj)


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = _param(2 * inter, hidden)
        self.down_proj = _param(hidden, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(activation.silu_and_mul(F.linear(x, self.gate_up_proj)), self.down_proj)


class Experts(nn.Module):
    """Routed experts beside always-on shared ones."""

    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = _param(cfg.num_experts, h)
        self.experts = nn.ModuleList(Expert(h, inter) for _ in range(cfg.num_experts))
        self.shared_experts = Expert(h, inter * cfg.num_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        weights, chosen = ops.route(
            x, self.gate, cfg.num_experts_per_tok, cfg.topk_method, cfg.n_group, cfg.topk_group,
            cfg.routed_scaling_factor,
        )  # fmt: skip
        gate_up = [e.gate_up_proj for e in self.experts]
        routed = ops.moe(x, weights, chosen, gate_up, [e.down_proj for e in self.experts])
        return routed + self.shared_experts(x)


class DeepseekLayer(nn.Module):
    def __init__(self, cfg: DeepseekConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = _param(cfg.hidden_size)
        self.post_attention_layernorm = _param(cfg.hidden_size)
        self.self_attn = LatentAttention(cfg)
        moe = cfg.is_moe(index)
        self.mlp = Experts(cfg) if moe else Expert(cfg.hidden_size, cfg.intermediate_size)


class DeepseekV2ForCausalLM(Model):
    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)
        self.rope: ops.InterleavedRope | None = None

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.cfg.max_position_embeddings

    def kv_arenas(self, block_size: int) -> list[ArenaSpec]:
        cfg, dtype = self.cfg, self.embed_tokens.dtype
        return [
            ArenaSpec("ckv", cfg.num_layers, (block_size, cfg.kv_lora_rank), dtype),
            ArenaSpec("kpe", cfg.num_layers, (block_size, cfg.qk_rope_head_dim), dtype),
        ]

    def init_runtime(self, runtime: RuntimeConfig) -> None:
        device = self.embed_tokens.device
        self.rope = ops.InterleavedRope(self.cfg.rope, runtime.max_model_len, device)

    def prepare(self, batch: ForwardBatch) -> None:
        pass  # the reference attention plans nothing

    def checkpoint_name_map(self, name: str) -> WeightTarget | None:
        """Map a Hugging Face checkpoint tensor name to our (fused) parameter."""
        if name == "lm_head.weight":
            return None if self.cfg.tie_word_embeddings else WeightTarget("lm_head")
        if not name.startswith("model.") or not name.endswith(".weight"):
            return WeightTarget(name)  # unknown: the loader reports it
        path = name.removeprefix("model.").removesuffix(".weight")
        module, _, leaf = path.rpartition(".")
        if leaf in ("gate_proj", "up_proj"):
            layer = int(path.split(".")[1])
            inter = self.cfg.intermediate_size
            if ".experts." in module or module.endswith("shared_experts"):
                inter = self.cfg.moe_intermediate_size
                if module.endswith("shared_experts"):
                    inter *= self.cfg.num_shared_experts
            elif self.cfg.is_moe(layer):
                return WeightTarget(path)  # not a layout we know: the loader reports it
            offset = 0 if leaf == "gate_proj" else inter
            return WeightTarget(f"{module}.gate_up_proj", offset, inter)
        return WeightTarget(path)

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        rope, cfg = self.rope, self.cfg
        assert rope is not None, "init_runtime() must run before the first step"
        ckv, kpe, eps = kv_cache["ckv"], kv_cache["kpe"], cfg.rms_norm_eps
        hidden = F.embedding(batch.input_ids, self.embed_tokens)
        residual = None
        for index, layer in enumerate(self.layers):
            x, residual = rms_norm.add_rms_norm(hidden, residual, layer.input_layernorm, eps)
            hidden = layer.self_attn(x, batch, ckv[index], kpe[index], rope)
            x, residual = rms_norm.add_rms_norm(
                hidden, residual, layer.post_attention_layernorm, eps
            )
            hidden = layer.mlp(x)
        rows = batch.logits_indices
        x, _ = rms_norm.add_rms_norm(hidden[rows], residual[rows], self.norm, eps)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(x, head).float()
