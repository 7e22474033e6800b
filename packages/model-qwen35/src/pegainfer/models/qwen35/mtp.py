"""Qwen3.5's multi-token-prediction (MTP) layer, the line's speculative-decoding drafter.

transformers has no MTP (it drops `mtp.*`); this follows vLLM's `qwen3_5_mtp.py`. For position
i, with h_i the target's final hidden state there (after its last norm) and e the embedding of
token i + 1: `fc(concat[norm_e(e), norm_h(h_i)])` (2H -> H, zero-centred norms), one
full-attention Qwen3.5 decoder layer at position i over its own paged KV (arena "mtp_kv", in
the sequences' block tables), then `mtp.norm`; the main LM head reads that to predict token
i + 2. Core's `MTPDrafter` runs it (`core.speculative.mtp`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from pegainfer.core.distributed import parallel
from pegainfer.core.kv.kv_cache import KVCache
from pegainfer.core.loading.weights import WeightTarget, empty_param
from pegainfer.core.ops import rms_norm
from pegainfer.core.runner.forward_batch import ForwardBatch
from pegainfer.core.speculative.mtp import MTPLayer
from pegainfer.models.qwen35.config import FULL, Qwen35Config
from pegainfer.models.qwen35.model import Qwen35ForCausalLM, Qwen35Layer

#: The MTP layer's KV arena.
MTP_KV = "mtp_kv"
_LAYER = "mtp.layers.0."


class Qwen35MTP(MTPLayer):
    """The `mtp.*` weights and the layer's forward; `target` lends its name mapping of a
    decoder layer's tensors (fused projections) and, when running, its embedding, rotary
    tables, attention backend and layer ops."""

    def __init__(self, cfg: Qwen35Config, target: Qwen35ForCausalLM) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.fc = empty_param(h, 2 * h)
        self.pre_fc_norm_embedding = empty_param(h)
        self.pre_fc_norm_hidden = empty_param(h)
        self.layer = Qwen35Layer(cfg, FULL, target.group)
        self.norm = empty_param(h)
        self._target = [target]  # a list: not a submodule (its weights are not ours)

    def checkpoint_name_map(self, name: str) -> WeightTarget | list[WeightTarget] | None:
        if not name.startswith("mtp."):
            return None
        if name.startswith(_LAYER):  # as the target maps a decoder layer's, renamed
            mapped = self._target[0].checkpoint_name_map("model.layers.0." + name[len(_LAYER) :])
            targets = [mapped] if isinstance(mapped, WeightTarget) else mapped or []
            return [dataclasses.replace(t, param="layer." + t.param.removeprefix("layers.0."))
                    for t in targets]  # fmt: skip
        return WeightTarget(name.removeprefix("mtp.").removesuffix(".weight"))

    def target_hidden_states(self) -> torch.Tensor:
        return self._target[0].final_hidden_states()

    def plan(self, batch: ForwardBatch) -> None:
        self._target[0].attn.plan(batch)

    def forward(
        self, ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache
    ) -> torch.Tensor:
        """The layer's output after `mtp.norm` [T, H] is the next draft's `hidden`."""
        target, cfg, kv = self._target[0], self.cfg, kv_cache[MTP_KV][0]
        eps, ops, layer = cfg.rms_norm_eps, target.ops, self.layer
        embedded = parallel.vocab_parallel_embedding(ids, target.embed_tokens, target.group)
        x = torch.cat([
            rms_norm.rms_norm(embedded, self.pre_fc_norm_embedding, eps, True),
            rms_norm.rms_norm(hidden, self.pre_fc_norm_hidden, eps, True),
        ], dim=-1)  # fmt: skip
        x, residual = ops.add_rms_norm(F.linear(x, self.fc), None, layer.input_layernorm, eps, True)
        x = layer.self_attn(x, batch, kv, target.rope, target.attn)
        x, residual = ops.add_rms_norm(x, residual, layer.post_attention_layernorm, eps, True)
        out, _ = ops.add_rms_norm(layer.mlp(x, ops), residual, self.norm, eps, True)
        return out

    def greedy(self, out: torch.Tensor) -> torch.Tensor:
        """The target's LM head's argmax."""
        target = self._target[0]
        head = target.embed_tokens if target.lm_head is None else target.lm_head
        return parallel.vocab_parallel_logits(out, head, target.group).argmax(dim=-1)
