"""Qwen3's forward pass over paged KV.

Two sets of ops compute the same function: plain torch ops (the reference and the CPU path,
following transformers' `Qwen3ForCausalLM` op for op, casts included) and, on CUDA, fused
Triton kernels plus FlashInfer attention. Parameters are fused where the GPU path wants them
fused: q/k/v in one matrix, gate/up in one.

Under tensor parallelism (`distributed.parallel`) each rank holds its share of the attention heads,
KV heads and MLP width (column-parallel q/k/v and gate/up, row-parallel o and down, whose
outputs are summed over the ranks) and of the vocabulary (embedding and LM head); `cfg` is the
rank's own shape, `full_cfg` the checkpoint's.

A quantized checkpoint (`Qwen/Qwen3-8B-FP8`: FP8 with 128x128 block scales) stores its linear
layers as `core.quant` says; embeddings, norms and the LM head stay in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pegainfer.core.attention.paged import GQAShape, PagedAttention, runtime_paged_attention
from pegainfer.core.dense import DenseOps, dense_ops
from pegainfer.core.distributed import parallel
from pegainfer.core.errors import ConfigError
from pegainfer.core.kv.kv_cache import ArenaSpec, KVCache
from pegainfer.core.layer_ops import LayerOps, layer_ops
from pegainfer.core.loading.weights import WeightTarget, empty_param
from pegainfer.core.model import Model
from pegainfer.core.model_line import RuntimeConfig
from pegainfer.core.ops import rms_norm
from pegainfer.core.ops.paged_attention import write_kv
from pegainfer.core.ops.rotary import RotaryEmbedding
from pegainfer.core.quant.linear import linear, linear_weight
from pegainfer.core.quant.scheme import QuantScheme
from pegainfer.core.runner.forward_batch import ForwardBatch
from pegainfer.models.qwen3.config import Qwen3Config


@dataclass(frozen=True)
class _Ops(LayerOps):
    dense: DenseOps
    fused_qk: Callable[..., torch.Tensor] | None = None  # q/k norm + RoPE + KV write at once


def _ops(device: torch.device, small_batch_gemv: bool = False) -> _Ops:
    common = layer_ops(device)
    dense = dense_ops(device, small_batch_gemv)
    if device.type != "cuda":
        return _Ops(common.add_rms_norm, common.silu_and_mul, dense)
    from pegainfer.models.qwen3.kernels import qk_norm_rope_kv_write

    return _Ops(common.add_rms_norm, common.silu_and_mul, dense, qk_norm_rope_kv_write)


class Qwen3Layer(nn.Module):
    def __init__(
        self,
        cfg: Qwen3Config,
        group: parallel.ParallelGroup,
        index: int,
        scheme: QuantScheme | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.group = group
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        h, inter = cfg.hidden_size, cfg.intermediate_size

        def fmt(*modules: str):  # how the checkpoint stores these layers (fused into one)
            names = [f"model.layers.{index}.{module}" for module in modules]
            return scheme.common_format(names) if scheme is not None else None

        self.input_layernorm = empty_param(h)
        qkv = fmt("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        self.qkv_proj = linear_weight(q_size + 2 * kv_size, h, qkv)
        self.q_norm = empty_param(cfg.head_dim)
        self.k_norm = empty_param(cfg.head_dim)
        self.o_proj = linear_weight(h, q_size, fmt("self_attn.o_proj"))
        self.post_attention_layernorm = empty_param(h)
        self.gate_up_proj = linear_weight(2 * inter, h, fmt("mlp.gate_proj", "mlp.up_proj"))
        self.down_proj = linear_weight(h, inter, fmt("mlp.down_proj"))

    def attention(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv_layer: torch.Tensor,
        rope: RotaryEmbedding,
        attn: PagedAttention,
        ops: _Ops,
    ) -> torch.Tensor:
        cfg = self.cfg
        tokens = x.shape[0]
        qkv = linear(x, self.qkv_proj)
        if ops.fused_qk is not None:
            q = ops.fused_qk(
                qkv, self.q_norm, self.k_norm, rope.cos, rope.sin, batch.positions,
                batch.slot_mapping, kv_layer, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps,
            )  # fmt: skip
        else:
            q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = rms_norm.rms_norm(q.view(tokens, cfg.num_heads, -1), self.q_norm, cfg.rms_norm_eps)
            k = rms_norm.rms_norm(
                k.view(tokens, cfg.num_kv_heads, -1), self.k_norm, cfg.rms_norm_eps
            )
            q = rope.apply(q, batch.positions)
            k = rope.apply(k, batch.positions)
            write_kv(kv_layer, k, v.view(tokens, cfg.num_kv_heads, cfg.head_dim), batch)
        out = attn.run(q, kv_layer)
        return parallel.row_parallel_linear(out.reshape(tokens, -1), self.o_proj, self.group)

    def mlp(self, x: torch.Tensor, ops: _Ops) -> torch.Tensor:
        h = ops.dense.gated(x, self.gate_up_proj)
        return parallel.row_parallel_linear(h, self.down_proj, self.group)


class Qwen3ForCausalLM(Model):
    supports_cuda_graphs = True
    supports_piecewise_graphs = True
    gqa_decode_kernels = True
    supports_small_batch_gemv = True

    def __init__(
        self,
        cfg: Qwen3Config,
        group: parallel.ParallelGroup | None = None,
        scheme: QuantScheme | None = None,
    ) -> None:
        super().__init__()
        if scheme is not None and scheme.format_for("lm_head") is not None:
            raise ConfigError("Qwen3 with a quantized LM head is not supported")
        self.group = group = group or parallel.ParallelGroup()
        self.full_cfg = cfg
        split = ("num_heads", "num_kv_heads", "intermediate_size")
        self.cfg = cfg = parallel.shard_config(cfg, group, split, vocab_size=cfg.vocab_size)
        vocab_rows = cfg.vocab_size // group.world_size
        self.embed_tokens = empty_param(vocab_rows, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Qwen3Layer(cfg, group, index, scheme) for index in range(cfg.num_layers)
        )
        self.norm = empty_param(cfg.hidden_size)
        self.lm_head = None if cfg.tie_word_embeddings else empty_param(vocab_rows, cfg.hidden_size)
        self.rope: RotaryEmbedding | None = None
        self.attn: PagedAttention | None = None
        self.ops: _Ops | None = None

    @property
    def vocab_size(self) -> int:
        return self.full_cfg.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.cfg.max_position_embeddings

    def kv_arenas(self, block_size: int) -> list[ArenaSpec]:
        cfg = self.cfg
        block = (2, block_size, cfg.num_kv_heads, cfg.head_dim)
        return [ArenaSpec("kv", cfg.num_layers, block, self.embed_tokens.dtype)]

    @property
    def attention_shape(self) -> GQAShape:
        return GQAShape(self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim)

    def init_runtime(self, runtime: RuntimeConfig) -> None:
        device, dtype = self.embed_tokens.device, self.embed_tokens.dtype
        attn = runtime_paged_attention(self.attention_shape, dtype, device, runtime)
        self.set_up_steps(runtime, attn, device)

    def set_up_steps(
        self, runtime: RuntimeConfig, attn: PagedAttention, kernels: torch.device
    ) -> None:
        """Rotary tables (on the model's device), `attn`, and the ops of the `kernels` device
        type (CUDA's on a meta model: `kernel_plan`)."""
        cfg = self.cfg
        device = self.embed_tokens.device
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, runtime.max_model_len, device)
        self.attn = attn
        self.ops = _ops(kernels, runtime.small_batch_gemv)

    def prepare(self, batch: ForwardBatch) -> None:
        assert self.attn is not None, "init_runtime() must run before the first step"
        self.attn.plan(batch)

    def prepare_graph(self, batch: ForwardBatch, bucket: int) -> None:
        assert self.attn is not None, "init_runtime() must run before the first step"
        self.attn.plan_graph(batch, bucket)

    def checkpoint_name_map(self, name: str) -> WeightTarget | None:
        """Map a Hugging Face checkpoint tensor name to our (fused) parameter, and to the
        rows or columns of it this rank keeps."""
        cfg, rank = self.cfg, self.group.rank
        vocab_rows = self.embed_tokens.shape[0]
        vocab = (rank * vocab_rows, (rank + 1) * vocab_rows)
        if name == "lm_head.weight":
            return None if cfg.tie_word_embeddings else WeightTarget("lm_head", rows=vocab)
        if not name.startswith("model.") or not name.endswith(".weight"):
            return WeightTarget(name)  # unknown: the loader reports it
        parts = name.removeprefix("model.").removesuffix(".weight").split(".")
        if parts[0] != "layers":
            return WeightTarget(parts[0], rows=vocab if parts[0] == "embed_tokens" else None)
        layer = f"layers.{parts[1]}"
        leaf = parts[-1]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size

        def mine(size: int) -> tuple[int, int]:  # this rank's part of a split dimension
            return rank * size, (rank + 1) * size

        shards = {
            "q_proj": WeightTarget(f"{layer}.qkv_proj", 0, q_size, rows=mine(q_size)),
            "k_proj": WeightTarget(f"{layer}.qkv_proj", q_size, kv_size, rows=mine(kv_size)),
            "v_proj": WeightTarget(f"{layer}.qkv_proj", q_size + kv_size, kv_size,
                                   rows=mine(kv_size)),
            "o_proj": WeightTarget(f"{layer}.o_proj", cols=mine(q_size)),
            "gate_proj": WeightTarget(f"{layer}.gate_up_proj", 0, inter, rows=mine(inter)),
            "up_proj": WeightTarget(f"{layer}.gate_up_proj", inter, inter, rows=mine(inter)),
            "down_proj": WeightTarget(f"{layer}.down_proj", cols=mine(inter)),
        }  # fmt: skip
        return shards.get(leaf) or WeightTarget(f"{layer}.{leaf}")

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        return self.logits(self.hidden_states(batch, kv_cache), batch)

    def hidden_states(
        self, batch: ForwardBatch, kv_cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's output and the residual stream, every row (the final norm adds
        them)."""
        rope, attn, ops = self.rope, self.attn, self.ops
        assert rope is not None and attn is not None and ops is not None
        eps = self.cfg.rms_norm_eps
        kv = kv_cache["kv"]
        hidden = parallel.vocab_parallel_embedding(batch.input_ids, self.embed_tokens, self.group)
        residual = None
        for index, layer in enumerate(self.layers):
            x, residual = ops.add_rms_norm(hidden, residual, layer.input_layernorm, eps)
            hidden = layer.attention(x, batch, kv[index], rope, attn, ops)
            x, residual = ops.add_rms_norm(hidden, residual, layer.post_attention_layernorm, eps)
            hidden = layer.mlp(x, ops)
        return hidden, residual

    def logits(
        self, states: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch
    ) -> torch.Tensor:
        # Only the rows that sample go through the final norm and the LM head.
        hidden, residual = states
        rows = batch.logits_indices
        x, _ = self.ops.add_rms_norm(hidden[rows], residual[rows], self.norm, self.cfg.rms_norm_eps)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return parallel.vocab_parallel_logits(x, head, self.group, self.ops.dense.head).float()

    def piecewise_cuts(self) -> list[PagedAttention]:
        assert self.attn is not None, "init_runtime() must run before the first step"
        return [self.attn]
