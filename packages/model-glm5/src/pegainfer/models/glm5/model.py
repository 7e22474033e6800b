"""GLM-5's forward pass: core's latent-attention MoE decoder (`core.latent_moe`) whose
attention is DeepSeek sparse attention (`core.attention.sparse`).

Each layer with a `full` indexer projects its indexer queries, keys and head weights
(`indexer.Indexer`), stores the keys in its slice of the `index_k` arena (one more KV arena:
the block manager, prefix cache, preemption and host tier cover it as they cover the latents)
and selects each row's top-k keys; a `shared` layer (GLM-5.2) attends over the last full
layer's selection. A sequence that fits in `index_topk` keys would select every key it has:
its rows attend dense MLA, unscored, beside the longer sequences' sparse rows.

The MTP layer's tensors (`model.layers.{num_hidden_layers}.*`) are not the model's (core's name
map passes them over): with speculative decoding they load into the drafter (`mtp.Glm5MTP`),
whose caches join the model's arenas. Piecewise CUDA graphs for mixed steps are not offered
(the selection's shapes follow the step's sequences); decode graphs are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pegainfer.core.attention.sparse import (
    IndexerShape,
    SparseLatentAttention,
    make_sparse_latent_attention,
)
from pegainfer.core.distributed import parallel
from pegainfer.core.kv.kv_cache import ArenaSpec, KVCache
from pegainfer.core.latent_moe.attention import LatentAttention
from pegainfer.core.latent_moe.config import LatentMoEConfig
from pegainfer.core.latent_moe.model import LatentMoEForCausalLM
from pegainfer.core.loading.weights import WeightTarget
from pegainfer.core.model_line import RuntimeConfig
from pegainfer.core.ops.interleaved_rope import InterleavedRope
from pegainfer.core.quant.scheme import QuantScheme
from pegainfer.core.runner.forward_batch import ForwardBatch
from pegainfer.models.glm5.config import Glm5Config
from pegainfer.models.glm5.indexer import Indexer

if TYPE_CHECKING:
    from pegainfer.models.glm5.mtp import Glm5MTP

# The indexer's checkpoint tensors (under `self_attn.indexer.`) and our parameters.
_INDEXER_TENSORS = {"wq_b.weight": "wq_b", "wk.weight": "wk", "weights_proj.weight":
                    "weights_proj", "k_norm.weight": "k_norm_weight",
                    "k_norm.bias": "k_norm_bias"}  # fmt: skip


class SparseAttention(LatentAttention):
    """MLA over the rows' selections; with a `full` indexer, the layer makes its own."""

    def __init__(
        self, cfg: Glm5Config, group: parallel.ParallelGroup, scheme: QuantScheme | None,
        layer: str, full: bool,
    ) -> None:  # fmt: skip
        super().__init__(cfg, group, scheme, layer)
        self.indexer = Indexer(cfg, scheme, f"{layer}.self_attn.indexer") if full else None

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
        rope: InterleavedRope,
        attn: SparseLatentAttention,
        selection: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's output and the selection it attended over (a full layer's own; else
        `selection`, the last full layer's). `caches`: the layer's latents, rope keys and
        indexer keys (None in a shared layer)."""
        ckv, kpe, k_layer = caches
        q = self.queries(x, batch, ckv, kpe, rope)
        if self.indexer is not None:
            index_q, weights = self.indexer(x, q.q_lora, batch, rope, k_layer)
            selection = attn.select(index_q, weights, k_layer)
        out = attn.run(q.q_nope, q.q_pe, ckv, kpe, self.kv_b, selection)
        return self.output(out), selection


class Glm5ForCausalLM(LatentMoEForCausalLM):
    cfg: Glm5Config
    attn: SparseLatentAttention | None

    def __init__(
        self, cfg: Glm5Config, group: parallel.ParallelGroup | None = None,
        expert_parallel: bool = False, data_parallel: parallel.ParallelGroup | None = None,
        scheme: QuantScheme | None = None,
    ) -> None:  # fmt: skip
        super().__init__(cfg, group, expert_parallel, data_parallel, scheme)
        self.supports_piecewise_graphs = False
        # Each full layer's place in the index_k arena.
        self.index_slot = {layer: i for i, layer in enumerate(cfg.full_indexer_layers)}
        self.indexer_shape = IndexerShape(
            cfg.index_heads, cfg.index_head_dim, cfg.index_topk, cfg.index_scale
        )
        self._selection: torch.Tensor | None = None
        self.mtp: Glm5MTP | None = None  # speculative decoding's drafter, once attached

    def attention_layer(self, cfg: LatentMoEConfig, index: int) -> nn.Module:
        assert isinstance(cfg, Glm5Config)
        full = cfg.indexer_types[index] == "full"
        return SparseAttention(cfg, self.group, self.scheme, self.layer_name(index), full)

    def kv_arenas(self, block_size: int) -> list[ArenaSpec]:
        cfg, dtype = self.cfg, self.embed_tokens.dtype
        keys = ArenaSpec("index_k", len(self.index_slot), (block_size, cfg.index_head_dim), dtype)
        mtp = [] if self.mtp is None else self.mtp.kv_arenas(block_size)
        return [*super().kv_arenas(block_size), keys, *mtp]

    def make_attention(self, runtime: RuntimeConfig) -> SparseLatentAttention:
        device, dtype = self.embed_tokens.device, self.embed_tokens.dtype
        return make_sparse_latent_attention(
            self.latent_shape, self.indexer_shape, dtype, device, runtime
        )

    def attach_mtp(self, mtp: Glm5MTP) -> None:
        """Serve speculative decoding with `mtp` (after `init_runtime`, before the arenas are
        read and graphs captured): its caches join the model's arenas, and each forward keeps
        every row's final hidden state for it."""
        self.mtp = mtp
        self.keep_final_hidden_states()

    def checkpoint_name_map(self, name: str) -> WeightTarget | list[WeightTarget] | None:
        layer, sep, leaf = name.removeprefix("model.layers.").partition(".self_attn.indexer.")
        if sep and int(layer) < self.cfg.num_layers and leaf in _INDEXER_TENSORS:
            # Whole on every tensor-parallel rank (an MTP layer's: core's map leaves it).
            return WeightTarget(f"layers.{layer}.self_attn.indexer.{_INDEXER_TENSORS[leaf]}")
        return super().checkpoint_name_map(name)

    def attention(
        self, index: int, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache
    ) -> torch.Tensor:
        slot = self.index_slot.get(index)
        k_layer = None if slot is None else kv_cache["index_k"][slot]
        caches = (kv_cache["ckv"][index], kv_cache["kpe"][index], k_layer)
        hidden, self._selection = self.layers[index].self_attn(
            x, batch, caches, self.rope, self.attn, self._selection
        )
        return hidden
