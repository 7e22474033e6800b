"""Qwen3.5's multi-token-prediction (MTP) layer, the line's speculative-decoding drafter.

transformers has no MTP (it drops `mtp.*`); this follows vLLM's `qwen3_5_mtp.py`. For position
i, with h_i the target's final hidden state there (after its last norm) and e the embedding of
token i + 1: `fc(concat[norm_e(e), norm_h(h_i)])` (2H -> H, zero-centred norms), one
full-attention Qwen3.5 decoder layer at position i over its own paged KV (arena "mtp_kv", in
the sequences' block tables), then `mtp.norm`; the main LM head reads that to predict token
i + 2. The first draft runs the layer over every row of the step that stands (so its KV covers
every position the target computed); each further draft runs it once per request on its own
output and the draft before, one position on, as vLLM and SGLang do. Drafts are greedy.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer.core.distributed import parallel
from pegainfer.core.loading.weights import WeightTarget, empty_param
from pegainfer.core.ops import rms_norm
from pegainfer.core.runner.forward_batch import ForwardBatch, to_device
from pegainfer.core.runner.model_runner import ModelRunner
from pegainfer.core.speculative.drafter import Drafter, DraftInputs, Drafts
from pegainfer.models.qwen35.config import FULL, Qwen35Config
from pegainfer.models.qwen35.model import Qwen35ForCausalLM, Qwen35Layer

#: The MTP layer's KV arena.
MTP_KV = "mtp_kv"
_LAYER = "mtp.layers.0."


class Qwen35MTP(nn.Module):
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

    def forward(
        self, ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv: torch.Tensor
    ) -> torch.Tensor:
        """`hidden` [T, H]: the state each row continues from (the target's, or the layer's
        own); `ids` [T]: the token after each row's position. Returns the layer's output
        after `mtp.norm` [T, H], the next draft's `hidden`."""
        target, cfg = self._target[0], self.cfg
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
        """The draft each row of `out` predicts: the target's LM head's argmax."""
        target = self._target[0]
        head = target.embed_tokens if target.lm_head is None else target.lm_head
        return parallel.vocab_parallel_logits(out, head, target.group).argmax(dim=-1)


class MTPDrafter(Drafter):
    def __init__(
        self, target: Qwen35ForCausalLM, mtp: Qwen35MTP, runner: ModelRunner, num_tokens: int
    ) -> None:
        super().__init__(num_tokens)
        self.target = target
        self.mtp = mtp
        self.runner = runner

    def propose(self, inputs: DraftInputs) -> Drafts:
        runner, device, target = self.runner, self.runner.device, self.target
        kv = runner.kv_cache[MTP_KV][0]
        # First draft: every standing row, fed the token after it, from the target's state.
        chunks = [r.token_ids[start + 1 : start + 1 + kept]
                  for r, start, kept in zip(inputs.requests, inputs.starts, inputs.kept,
                                            strict=True)]  # fmt: skip
        rows = [first + j for first, kept in zip(inputs.first_rows, inputs.kept, strict=True)
                for j in range(kept)]  # fmt: skip
        tables = [r.block_ids for r in inputs.requests]
        batch = ForwardBatch.build(chunks, inputs.starts, tables, inputs.drafting,
                                   runner.block_size, device)  # fmt: skip
        hidden = target.final_hidden_states()[to_device(rows, device)]
        target.attn.plan(batch)
        out = self.mtp(batch.input_ids, hidden, batch, kv)[batch.logits_indices]
        drafts = [self.mtp.greedy(out)]
        # Further drafts: the layer on its own output and the draft before, one position on.
        requests = inputs.drafted
        count, drafted_tables = len(requests), [r.block_ids for r in requests]
        for j in range(1, self.num_tokens):
            positions = [r.num_tokens - 2 + j for r in requests]
            batch = ForwardBatch.build([[0]] * count, positions, drafted_tables, [True] * count,
                                       runner.block_size, device)  # fmt: skip
            batch.input_ids.copy_(drafts[-1])
            target.attn.plan(batch)
            out = self.mtp(batch.input_ids, out, batch, kv)
            drafts.append(self.mtp.greedy(out))
        return Drafts(torch.stack(drafts, dim=1).tolist())
