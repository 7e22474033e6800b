"""Drafting with a checkpoint's multi-token-prediction (MTP) layer, as vLLM's `EagleProposer`
runs `method == "mtp"` (Qwen3.5's `mtp.*`, GLM-5's and DeepSeek-V3's `model.layers.{L}.*`).

The layer at position p reads the target's final hidden state there and the token at p + 1,
and predicts the token at p + 2, writing its own KV at p (in the sequences' block tables, an
arena of its own). After a step, the first draft runs the layer over every row of the step that
stands (so its KV covers every position the target computed, whatever chunk computed it): each
row continues from the target's state and reads the token after it, the last row of a sampling
request the token just accepted. Each further draft runs the layer once per request on its own
output and the draft before, one position on. Drafts are greedy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from pegainfer.core.kv.kv_cache import KVCache
from pegainfer.core.runner.forward_batch import ForwardBatch, to_device
from pegainfer.core.runner.model_runner import ModelRunner
from pegainfer.core.speculative.drafter import Drafter, DraftInputs, Drafts


class MTPLayer(nn.Module, ABC):
    """A line's MTP layer, with what it borrows from its target model."""

    @abstractmethod
    def target_hidden_states(self) -> torch.Tensor:
        """Every row of the target's last forward after its final norm ([rows, H]: a buffer
        at least as long as that step; graph replays fill it too)."""

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> None:
        """Plan the layer's attention for `batch` (the target's step is done)."""

    @abstractmethod
    def forward(
        self, ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache
    ) -> torch.Tensor:
        """`hidden` [T, H]: the state each row continues from (the target's, or the layer's
        own output); `ids` [T]: the token after each row's position. Writes the rows' KV in
        the layer's arenas of `kv_cache`; returns the state the next draft continues from."""

    @abstractmethod
    def greedy(self, out: torch.Tensor) -> torch.Tensor:
        """The token each row of `forward`'s output predicts (the argmax of its logits)."""


class MTPDrafter(Drafter):
    def __init__(self, layer: MTPLayer, runner: ModelRunner, num_tokens: int) -> None:
        super().__init__(num_tokens)
        self.layer = layer
        self.runner = runner

    def propose(self, inputs: DraftInputs) -> Drafts:
        runner, device, layer = self.runner, self.runner.device, self.layer
        kv_cache = runner.kv_cache
        # First draft: every standing row, fed the token after it, from the target's state.
        chunks = [r.token_ids[start + 1 : start + 1 + kept]
                  for r, start, kept in zip(inputs.requests, inputs.starts, inputs.kept,
                                            strict=True)]  # fmt: skip
        rows = [first + j for first, kept in zip(inputs.first_rows, inputs.kept, strict=True)
                for j in range(kept)]  # fmt: skip
        tables = [r.block_ids for r in inputs.requests]
        batch = ForwardBatch.build(chunks, inputs.starts, tables, inputs.drafting,
                                   runner.block_size, device)  # fmt: skip
        hidden = layer.target_hidden_states()[to_device(rows, device)]
        layer.plan(batch)
        out = layer(batch.input_ids, hidden, batch, kv_cache)[batch.logits_indices]
        requests = inputs.drafted
        if not requests:  # only prompt chunks that do not sample: their KV is written
            return Drafts([])
        drafts = [layer.greedy(out)]
        # Further drafts: the layer on its own output and the draft before, one position on.
        count, drafted_tables = len(requests), [r.block_ids for r in requests]
        for j in range(1, self.num_tokens):
            positions = [r.num_tokens - 2 + j for r in requests]
            batch = ForwardBatch.build([[0]] * count, positions, drafted_tables, [True] * count,
                                       runner.block_size, device)  # fmt: skip
            batch.input_ids.copy_(drafts[-1])
            layer.plan(batch)
            out = layer(batch.input_ids, out, batch, kv_cache)
            drafts.append(layer.greedy(out))
        return Drafts(torch.stack(drafts, dim=1).tolist())
