"""A test-only model line, installed through a real entry point by `test_plugins.py`.

Its model ignores attention and predicts `(last token + 1) % vocab`, so what the engine
generates with it is known in advance. It still declares a KV arena, so the engine's sizing
and block accounting run as they do for real lines.
"""

from __future__ import annotations

from typing import Any

import torch

from pegainfer.core.kv.kv_cache import ArenaSpec, KVCache
from pegainfer.core.model import Model, ModelContext
from pegainfer.core.model_line import ModelLine, Probe, RuntimeConfig
from pegainfer.core.plugins import hookimpl
from pegainfer.core.runner.forward_batch import ForwardBatch


class CountingModel(Model):
    def __init__(self, vocab: int, device: torch.device) -> None:
        super().__init__()
        self._vocab = vocab
        self.device = device

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def max_position_embeddings(self) -> int:
        return 256

    def kv_arenas(self, block_size: int) -> list[ArenaSpec]:
        return [ArenaSpec("state", 1, (block_size,), torch.float32)]

    def init_runtime(self, runtime: RuntimeConfig) -> None:
        pass

    def prepare(self, batch: ForwardBatch) -> None:
        pass

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        last = batch.input_ids[batch.logits_indices]
        return torch.nn.functional.one_hot((last + 1) % self._vocab, self._vocab).float() * 10


class CountingLine(ModelLine):
    name = "counting"
    unsupported_args = frozenset({"block_size"})

    def probe(self, config: dict[str, Any]) -> Probe:
        if config.get("model_type") == "counting":
            return Probe.claim()
        return Probe.reject("model_type is not 'counting'")

    def build_model(self, ctx: ModelContext) -> Model:
        return CountingModel(int(ctx.config["vocab_size"]), ctx.device)


@hookimpl
def pegainfer_model_lines() -> list[ModelLine]:
    return [CountingLine()]
