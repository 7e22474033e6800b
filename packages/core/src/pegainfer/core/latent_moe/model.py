"""A latent-attention MoE decoder's forward pass over a paged latent cache (DeepSeek-V2/V3,
Kimi-K2): MLA attention (`latent_moe.attention`), then a dense MLP (the first
`first_k_dense_replace` layers) or routed plus shared experts (`core.moe`).

Under tensor parallelism (`distributed.parallel`) each rank holds its share of the attention
heads, of the dense and shared MLPs' width and of the vocabulary, and its share of every routed
expert's width or, with expert parallelism (`ModelContext.expert_parallel`), a range of whole
routed experts. Either way every rank routes every token, computes its terms, and one
all-reduce sums routed and shared outputs; the latent cache is whole on every rank.

With data-parallel attention (`ModelContext.data_parallel`) each rank holds every weight but
the routed experts, of which it holds a range, and runs its own sequences (its own latent
cache): each MoE layer sends tokens to their experts' ranks and back (`core.expert_parallel`),
and every rank's final rows are gathered to compute every rank's logits on rank 0 (the
others return none).

Each cached token holds its normalised KV latent (the `ckv` arena, `kv_lora_rank` values per
layer) and its roped shared key (`kpe`, `qk_rope_head_dim`), the layout FlashInfer's MLA
kernels read. Attention is core's (`core.attention.latent`, given `kv_b_proj` per head): long
prefill chunks in the expanded form (cached latents up-projected to keys and values, FlashInfer's
ragged prefill on CUDA), decodes and short chunks absorbed (the key up-projection folded into the
query, the value one applied to the latent output, FlashInfer's MLA on CUDA); torch references
elsewhere. Routed experts are stacked (`moe.layer.RoutedExperts`): a fused Triton MoE on CUDA,
expert by expert on the CPU; MLA's attention input is one Triton kernel on CUDA.

A quantized checkpoint (`scheme`: Kimi-K2-Instruct's and GLM-5-FP8's FP8 blocks, K2-Thinking's
INT4 experts) stores each linear layer as `core.quant` says; embeddings, norms, the router and
the LM head stay in the model's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from pegainfer.core.attention.latent import (
    LatentShape,
    MultiHeadLatentAttention,
    make_latent_attention,
)
from pegainfer.core.distributed import parallel
from pegainfer.core.errors import ConfigError
from pegainfer.core.kv.kv_cache import ArenaSpec, KVCache
from pegainfer.core.latent_moe.attention import LatentAttention
from pegainfer.core.latent_moe.config import LatentMoEConfig
from pegainfer.core.layer_ops import LayerOps, layer_ops
from pegainfer.core.loading.weights import WeightTarget, empty_param
from pegainfer.core.model import Model
from pegainfer.core.model_line import RuntimeConfig
from pegainfer.core.moe.layer import DenseMLP, MLPFormats, MoE
from pegainfer.core.ops.interleaved_rope import InterleavedRope
from pegainfer.core.quant.scheme import QuantScheme
from pegainfer.core.runner.forward_batch import ForwardBatch


def mlp_formats(scheme: QuantScheme | None, modules: list[str]) -> MLPFormats:
    """How the checkpoint stores the SwiGLU MLPs `modules` (checkpoint names, e.g. every
    `model.layers.3.mlp.experts.E`), which run as one."""
    if scheme is None:
        return MLPFormats()
    leaves = ("gate_proj", "up_proj")
    gate_up = scheme.common_format(f"{m}.{leaf}" for m in modules for leaf in leaves)
    return MLPFormats(gate_up, scheme.common_format(f"{m}.down_proj" for m in modules))


class LatentMoELayer(nn.Module):
    def __init__(
        self, cfg: LatentMoEConfig, index: int, attention: nn.Module,
        group: parallel.ParallelGroup, expert_parallel: bool,
        data_parallel: parallel.ParallelGroup, scheme: QuantScheme | None = None,
        name: str = "",
    ) -> None:  # fmt: skip
        """Layer `index`, `name` in the checkpoint (how `scheme` knows its MLP)."""
        super().__init__()
        self.input_layernorm = empty_param(cfg.hidden_size)
        self.post_attention_layernorm = empty_param(cfg.hidden_size)
        self.self_attn = attention
        mlp = f"{name}.mlp"
        if cfg.is_moe(index):
            experts = [f"{mlp}.experts.{e}" for e in range(cfg.num_experts)]
            self.mlp: nn.Module = MoE(
                cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_shared_experts, cfg.routing,
                group, expert_parallel, data_parallel, mlp_formats(scheme, experts),
                mlp_formats(scheme, [f"{mlp}.shared_experts"]),
            )  # fmt: skip
        else:
            formats = mlp_formats(scheme, [mlp])
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, group, formats)


class LatentMoEForCausalLM(Model):
    def __init__(
        self, cfg: LatentMoEConfig, group: parallel.ParallelGroup | None = None,
        expert_parallel: bool = False, data_parallel: parallel.ParallelGroup | None = None,
        scheme: QuantScheme | None = None, checkpoint_prefix: str = "",
    ) -> None:  # fmt: skip
        """`scheme`: how the checkpoint stores the linear layers (None: unquantized), which
        it names under `checkpoint_prefix` (a vision-language checkpoint's text model)."""
        super().__init__()
        if scheme is not None and scheme.format_for(f"{checkpoint_prefix}lm_head") is not None:
            raise ConfigError("a quantized LM head is not supported")
        self.scheme, self.checkpoint_prefix = scheme, checkpoint_prefix
        self.group = group = group or parallel.ParallelGroup()
        self.data_parallel = data_parallel = data_parallel or parallel.ParallelGroup()
        if data_parallel.world_size > 1 and group.world_size > 1:
            raise ConfigError("data-parallel attention with tensor parallelism is not built yet")
        # Whole experts per attention rank.
        parallel.shard_config(cfg, data_parallel, (), num_experts=cfg.num_experts)
        self.full_cfg = cfg
        shared_width = cfg.moe_intermediate_size * cfg.num_shared_experts
        # Routed experts split by count (expert parallel) or each by width.
        routed = ({"num_experts": cfg.num_experts} if expert_parallel
                  else {"moe_intermediate_size": cfg.moe_intermediate_size})  # fmt: skip
        self.cfg = cfg = parallel.shard_config(
            cfg, group, ("num_heads", "intermediate_size"), **routed,
            shared_experts_width=shared_width, vocab_size=cfg.vocab_size,
        )  # fmt: skip
        vocab_rows = cfg.vocab_size // group.world_size
        self.embed_tokens = empty_param(vocab_rows, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LatentMoELayer(cfg, i, self.attention_layer(cfg, i), group, expert_parallel,
                           data_parallel, scheme, self.layer_name(i))
            for i in range(cfg.num_layers)
        )  # fmt: skip
        self.norm = empty_param(cfg.hidden_size)
        self.lm_head = None if cfg.tie_word_embeddings else empty_param(vocab_rows, cfg.hidden_size)
        self.rope: InterleavedRope | None = None
        self.latent_shape = LatentShape(
            cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim,
            cfg.v_head_dim, cfg.softmax_scale,
        )  # fmt: skip
        # Decode graphs need FlashInfer's MLA (the reference attention plans on the host).
        self.supports_cuda_graphs = self.latent_shape.flashinfer_supported
        self.supports_piecewise_graphs = self.supports_cuda_graphs
        self.attn: MultiHeadLatentAttention | None = None
        self.ops: LayerOps | None = None
        # For an MTP drafter (speculative decoding): every row's final hidden state of the last
        # forward, in a buffer as long as the longest step (graph replays fill it too).
        self._max_rows = 0
        self._final_hidden: torch.Tensor | None = None

    def attention_layer(self, cfg: LatentMoEConfig, index: int) -> nn.Module:
        """Layer `index`'s attention module (a line with another attention overrides this)."""
        return LatentAttention(cfg, self.group, self.scheme, self.layer_name(index))

    def layer_name(self, index: int) -> str:
        """Layer `index`'s name in the checkpoint."""
        return f"{self.checkpoint_prefix}model.layers.{index}"

    def after_loading(self) -> None:
        for layer in self.layers:
            layer.self_attn.after_loading()

    @property
    def vocab_size(self) -> int:
        return self.full_cfg.vocab_size

    @property
    def transient_bytes(self) -> int:
        return 0 if self.attn is None else self.attn.transient_bytes

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
        self.set_up_steps(runtime, self.make_attention(runtime), self.embed_tokens.device)

    def make_attention(self, runtime: RuntimeConfig) -> MultiHeadLatentAttention:
        """The attention backend every layer runs (a line with another attention overrides
        this)."""
        device, dtype = self.embed_tokens.device, self.embed_tokens.dtype
        return make_latent_attention(self.latent_shape, dtype, device, runtime)

    def set_up_steps(
        self, runtime: RuntimeConfig, attn: MultiHeadLatentAttention, kernels: torch.device
    ) -> None:
        """Rotary tables (on the model's device), `attn`, and the element-wise ops of the
        `kernels` device type (CUDA's on a meta model: `kernel_plan`)."""
        self.rope = InterleavedRope(self.cfg.rope, runtime.max_model_len, self.embed_tokens.device)
        self.attn = attn
        self.ops = layer_ops(kernels)
        self._max_rows = max(runtime.max_num_batched_tokens, *runtime.graph_buckets, 1)

    def keep_final_hidden_states(self) -> None:
        """From now on (after `init_runtime`, before graphs are captured) every forward keeps
        each row's final hidden state, for an MTP drafter (`final_hidden_states`)."""
        if self.data_parallel.world_size > 1 or self.group.world_size > 1:
            raise ConfigError("an MTP drafter runs on one rank only")
        self._final_hidden = self.embed_tokens.new_empty(self._max_rows, self.cfg.hidden_size)

    def final_hidden_states(self) -> torch.Tensor:
        """Every row's hidden state after the final norm, of the last forward, in the rows of
        a buffer as long as the longest step (a graph replay fills it without running any
        Python: nothing here knows how many rows the last step had)."""
        assert self._final_hidden is not None, "keep_final_hidden_states() keeps them"
        return self._final_hidden

    def prepare(self, batch: ForwardBatch) -> None:
        assert self.attn is not None, "init_runtime() must run before the first step"
        self.attn.plan(batch)

    def prepare_graph(self, batch: ForwardBatch, bucket: int) -> None:
        assert self.attn is not None, "init_runtime() must run before the first step"
        self.attn.plan_graph(batch, bucket)

    def checkpoint_name_map(self, name: str) -> WeightTarget | None:
        """Map a Hugging Face checkpoint tensor name to our (fused) parameter, and to the
        rows or columns of it this rank keeps (None: another rank's expert)."""
        cfg, rank = self.cfg, self.group.rank

        def mine(size: int) -> tuple[int, int]:
            return rank * size, (rank + 1) * size

        vocab = mine(self.embed_tokens.shape[0])
        if name == "lm_head.weight":
            return None if cfg.tie_word_embeddings else WeightTarget("lm_head", rows=vocab)
        parts = name.split(".")
        if name.startswith("model.layers.") and int(parts[2]) >= cfg.num_layers:
            if int(parts[2]) < cfg.num_layers + cfg.mtp_layers:
                return None  # a multi-token-prediction layer: not run
            return WeightTarget(name)  # past every layer: the loader reports it
        if name.endswith(".mlp.gate.e_score_correction_bias"):  # noaux_tc's router bias
            return WeightTarget(name.removeprefix("model.").replace(".gate.", ".", 1))
        if not name.startswith("model.") or not name.endswith(".weight"):
            return WeightTarget(name)  # unknown: the loader reports it
        path = name.removeprefix("model.").removesuffix(".weight")
        if path == "embed_tokens":
            return WeightTarget(path, rows=vocab)
        module, _, leaf = path.rpartition(".")
        parts = path.split(".")
        if ".experts." in path:  # layers.N.mlp.experts.E.leaf: this rank's experts, stacked
            if leaf not in ("gate_proj", "up_proj", "down_proj"):
                return WeightTarget(path)  # not a layout we know: the loader reports it
            experts = self.layers[int(parts[1])].mlp.experts
            local = int(parts[4]) - experts.first
            if not 0 <= local < experts.count:
                return None  # another rank's expert
            stacked = ".".join(parts[:4])
            if leaf == "down_proj":
                h = cfg.hidden_size
                return WeightTarget(f"{stacked}.down_proj", local * h, h, cols=experts.width)
            inter = experts.inter
            offset = local * 2 * inter + (0 if leaf == "gate_proj" else inter)
            return WeightTarget(f"{stacked}.gate_up_proj", offset, inter, rows=experts.width)
        if module.endswith("shared_experts"):
            inter = cfg.moe_intermediate_size * cfg.num_shared_experts // self.group.world_size
            split = mine(inter)
        elif module.endswith("mlp") and leaf in ("gate_proj", "up_proj", "down_proj"):
            if cfg.is_moe(int(parts[1])):
                return WeightTarget(path)  # not a layout we know: the loader reports it
            inter, split = cfg.intermediate_size, mine(cfg.intermediate_size)
        else:
            heads = cfg.num_heads
            fused = f"{module}.q_kv_a_proj"
            q_rows = self.layers[0].self_attn.q_rows
            if leaf == "q_proj":  # this rank's heads
                return WeightTarget(fused, 0, q_rows, rows=mine(heads * cfg.qk_head_dim))
            if leaf == "q_a_proj":
                return WeightTarget(fused, 0, q_rows)
            if leaf == "kv_a_proj_with_mqa":
                return WeightTarget(fused, q_rows, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            rows = {"q_b_proj": heads * cfg.qk_head_dim,
                    "kv_b_proj": heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)}  # fmt: skip
            if leaf in rows:
                return WeightTarget(path, rows=mine(rows[leaf]))
            if leaf == "o_proj":
                return WeightTarget(path, cols=mine(heads * cfg.v_head_dim))
            return WeightTarget(path)
        if leaf == "down_proj":
            return WeightTarget(f"{module}.down_proj", cols=split)
        offset = 0 if leaf == "gate_proj" else inter
        return WeightTarget(f"{module}.gate_up_proj", offset, inter, rows=split)

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        return self.logits(self.hidden_states(batch, kv_cache), batch)

    def hidden_states(
        self, batch: ForwardBatch, kv_cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's output and the residual stream, every row."""
        elementwise, eps = self.ops, self.cfg.rms_norm_eps
        assert self.rope is not None and elementwise is not None, "init_runtime() must run first"
        capacity = max(batch.parallel_counts(self.data_parallel.world_size).tokens)
        hidden = parallel.vocab_parallel_embedding(batch.input_ids, self.embed_tokens, self.group)
        residual = None
        for index, layer in enumerate(self.layers):
            x, residual = elementwise.add_rms_norm(hidden, residual, layer.input_layernorm, eps)
            hidden = self.attention(index, x, batch, kv_cache)
            x, residual = elementwise.add_rms_norm(
                hidden, residual, layer.post_attention_layernorm, eps
            )
            if isinstance(layer.mlp, MoE):
                hidden = layer.mlp(x, elementwise, capacity)
            else:
                hidden = layer.mlp(x, elementwise)
        return hidden, residual

    def attention(
        self, index: int, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache
    ) -> torch.Tensor:
        """Layer `index`'s attention output for its normalised input x."""
        ckv, kpe = kv_cache["ckv"][index], kv_cache["kpe"][index]
        return self.layers[index].self_attn(x, batch, ckv, kpe, self.rope, self.attn)

    def logits(
        self, states: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch
    ) -> torch.Tensor:
        hidden, residual = states
        rows = batch.logits_indices
        counts = batch.parallel_counts(self.data_parallel.world_size)
        eps = self.cfg.rms_norm_eps
        if self._final_hidden is not None:  # an MTP drafter reads every row's
            x, _ = self.ops.add_rms_norm(hidden, residual, self.norm, eps)
            self._final_hidden[: x.shape[0]].copy_(x)
            x = x[rows]
        else:  # only the rows that sample go through the final norm and the LM head
            x, _ = self.ops.add_rms_norm(hidden[rows], residual[rows], self.norm, eps)
        x = self.data_parallel.gather_rows(x, counts.rows)  # every rank's rows, in rank order
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if self.data_parallel.rank > 0:  # rank 0 samples every rank's rows
            return x.new_empty(0, self.vocab_size, dtype=torch.float32)
        return parallel.vocab_parallel_logits(x, head, self.group).float()

    def piecewise_cuts(self) -> list[MultiHeadLatentAttention]:
        assert self.attn is not None, "init_runtime() must run before the first step"
        return [self.attn]
