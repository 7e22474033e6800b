"""GLM-5's multi-token-prediction (MTP) layer, the line's speculative-decoding drafter.

DeepSeek-V3's layout, as vLLM's `deepseek_mtp.py` runs it (vLLM maps `glm_moe_dsa` onto it;
transformers has no MTP and drops `model.layers.78.*`): the layer's tensors sit after the
decoder's, at `model.layers.{num_hidden_layers}.*`. For position i, with h_i the target's final
hidden state there (after its last norm) and e the embedding of token i + 1 (zero at position
0, as vLLM has it): `eh_proj(concat[enorm(e), hnorm(h_i)])` (2H -> H), then a whole GLM-5
decoder layer at position i (MLA with its own lightning indexer, MoE) over caches of its own in
the sequences' block tables (latents, rope keys and indexer keys: three more arenas); its output
plus the residual is the state the next draft continues from, and `shared_head.head` (the
layer's own LM head) over `shared_head.norm` of it predicts token i + 2. The embedding is the
target's (a checkpoint's `model.layers.{L}.embed_tokens` is a copy of it: vLLM shares it too).
Core's `MTPDrafter` runs the layer (`core.speculative.mtp`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from pegainfer.core.distributed import parallel
from pegainfer.core.errors import ConfigError
from pegainfer.core.kv.kv_cache import ArenaSpec, KVCache
from pegainfer.core.latent_moe.model import LatentMoELayer
from pegainfer.core.loading.weights import WeightTarget, empty_param
from pegainfer.core.ops.rms_norm import rms_norm
from pegainfer.core.runner.forward_batch import ForwardBatch
from pegainfer.core.speculative.mtp import MTPLayer
from pegainfer.models.glm5.config import Glm5Config
from pegainfer.models.glm5.model import Glm5ForCausalLM, SparseAttention

#: The MTP layer's caches: its latents, rope keys and indexer keys.
MTP_CKV, MTP_KPE, MTP_INDEX_K = "mtp_ckv", "mtp_kpe", "mtp_index_k"
# The layer's own tensors (checkpoint leaf -> parameter), beside its decoder layer's.
_OWN = {"enorm.weight": "enorm", "hnorm.weight": "hnorm", "eh_proj.weight": "eh_proj",
        "shared_head.norm.weight": "shared_head_norm",
        "shared_head.head.weight": "shared_head_head"}  # fmt: skip


class Glm5MTP(MTPLayer):
    """The layer's weights and forward; `target` lends its name mapping of a decoder layer's
    tensors and, when running, its embedding, RoPE tables, attention backend and layer ops."""

    def __init__(self, cfg: Glm5Config, target: Glm5ForCausalLM, expert_parallel: bool) -> None:
        """`cfg`: the target's (this rank's share); `expert_parallel` as the target's."""
        super().__init__()
        if cfg.mtp_layers != 1:
            raise ConfigError(
                f"the checkpoint has {cfg.mtp_layers} MTP layers (num_nextn_predict_layers); "
                "the glm5 line drafts with one"
            )
        index, h = cfg.num_layers, cfg.hidden_size
        # The target layer whose names the decoder layer's tensors are mapped as: a MoE layer
        # (the MTP layer is one), whose indexer tensors the target's map knows.
        self._proxy = cfg.num_layers - 1
        if not cfg.is_moe(self._proxy):
            raise ConfigError("the MTP layer is MoE, and no decoder layer is: not a GLM-5 layout")
        self.cfg = cfg
        name = target.layer_name(index)
        self.prefix = name + "."
        attention = SparseAttention(cfg, target.group, target.scheme, name, full=True)
        self.block = LatentMoELayer(cfg, index, attention, target.group, expert_parallel,
                                    target.data_parallel, target.scheme, name)  # fmt: skip
        self.enorm = empty_param(h)
        self.hnorm = empty_param(h)
        # Unquantized, as vLLM builds them (a plain nn.Linear, the head a ParallelLMHead): a
        # checkpoint that stores scales for them is refused by the loader, by name.
        self.eh_proj = empty_param(h, 2 * h)
        self.shared_head_norm = empty_param(h)
        self.shared_head_head = empty_param(target.embed_tokens.shape[0], h)
        self._target = [target]  # a list: not a submodule (its weights are not ours)

    def checkpoint_name_map(self, name: str) -> WeightTarget | list[WeightTarget] | None:
        if not name.startswith(self.prefix):
            return None  # the target's
        leaf = name.removeprefix(self.prefix)
        target = self._target[0]
        if leaf == "shared_head.head.weight":  # this rank's rows of the vocabulary
            rows, rank = target.embed_tokens.shape[0], target.group.rank
            return WeightTarget(_OWN[leaf], rows=(rank * rows, (rank + 1) * rows))
        if leaf in _OWN:
            return WeightTarget(_OWN[leaf])
        if leaf == "embed_tokens.weight":
            return None  # a copy of the target's embedding, which the layer reads
        # The decoder layer: as the target maps its own layer's tensors, renamed.
        proxy = target.layer_name(self._proxy)
        mapped = target.checkpoint_name_map(f"{proxy}.{leaf}")
        targets = [mapped] if isinstance(mapped, WeightTarget) else mapped or []
        layer = f"layers.{self._proxy}."
        return [dataclasses.replace(t, param="block." + t.param.removeprefix(layer))
                for t in targets]  # fmt: skip

    def after_loading(self) -> None:
        self.block.self_attn.after_loading()

    def kv_arenas(self, block_size: int) -> list[ArenaSpec]:
        cfg, dtype = self.cfg, self.enorm.dtype
        return [
            ArenaSpec(MTP_CKV, 1, (block_size, cfg.kv_lora_rank), dtype),
            ArenaSpec(MTP_KPE, 1, (block_size, cfg.qk_rope_head_dim), dtype),
            ArenaSpec(MTP_INDEX_K, 1, (block_size, cfg.index_head_dim), dtype),
        ]

    def target_hidden_states(self) -> torch.Tensor:
        return self._target[0].final_hidden_states()

    def plan(self, batch: ForwardBatch) -> None:
        self._target[0].prepare(batch)

    def forward(
        self, ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache
    ) -> torch.Tensor:
        """The decoder layer's output plus its residual [T, H] is the next draft's `hidden`."""
        target, cfg, layer = self._target[0], self.cfg, self.block
        eps, ops = cfg.rms_norm_eps, target.ops
        embedded = parallel.vocab_parallel_embedding(ids, target.embed_tokens, target.group)
        embedded = embedded.masked_fill((batch.positions == 0)[:, None], 0.0)
        x = torch.cat([rms_norm(embedded, self.enorm, eps), rms_norm(hidden, self.hnorm, eps)],
                      dim=-1)  # fmt: skip
        x, residual = ops.add_rms_norm(F.linear(x, self.eh_proj), None, layer.input_layernorm,
                                       eps)  # fmt: skip
        caches = (kv_cache[MTP_CKV][0], kv_cache[MTP_KPE][0], kv_cache[MTP_INDEX_K][0])
        x, _ = layer.self_attn(x, batch, caches, target.rope, target.attn, None)
        x, residual = ops.add_rms_norm(x, residual, layer.post_attention_layernorm, eps)
        return layer.mlp(x, ops, x.shape[0]) + residual

    def greedy(self, out: torch.Tensor) -> torch.Tensor:
        """The argmax of the layer's own LM head over `shared_head.norm` of `out`."""
        x = rms_norm(out, self.shared_head_norm, self.cfg.rms_norm_eps)
        return parallel.vocab_parallel_logits(x, self.shared_head_head, self._target[0].group
                                              ).argmax(dim=-1)  # fmt: skip
