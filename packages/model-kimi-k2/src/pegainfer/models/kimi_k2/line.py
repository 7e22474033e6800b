"""The Kimi-K2 line: claims `kimi_k2` and `deepseek_v3` checkpoints and the text model of
`kimi_k25` (K2.5, K2.6) ones, built on core's latent-attention MoE decoder."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pegainfer.core.errors import ConfigError
from pegainfer.core.loading.weights import build_and_load
from pegainfer.core.model_line import Model, ModelContext, ModelLine, Probe
from pegainfer.core.quant.scheme import parse_quantization
from pegainfer.core.text.tokenizer import Tokenizer
from pegainfer.models.kimi_k2.config import KimiCheckpoint
from pegainfer.models.kimi_k2.tokenizer import TIKTOKEN_FILE, load_kimi_tokenizer


class KimiK2Line(ModelLine):
    name = "kimi-k2"
    unsupported_args = frozenset({"state_checkpoints"})  # no recurrent layers
    supports_data_parallel = True
    tokenizer_file = TIKTOKEN_FILE
    # Kimi's calls in special tokens. No reasoning parser by default: K2-Instruct does not think,
    # and kimi_k2's split reads an answer as thinking from its first token (K2-Thinking, K2.5
    # and K2.6 think: serve them with --reasoning-parser kimi_k2, as vLLM does).
    tool_call_parser = "kimi_k2"

    def probe(self, config: dict[str, Any]) -> Probe:
        checkpoint = KimiCheckpoint.of(config)
        if isinstance(checkpoint, str):
            return Probe.reject(checkpoint)
        return Probe.claim()

    def build_model(self, ctx: ModelContext) -> Model:
        from pegainfer.models.kimi_k2.model import KimiK2ForCausalLM

        checkpoint = KimiCheckpoint.of(ctx.config)
        if isinstance(checkpoint, str):
            raise ConfigError(checkpoint)
        ctx = dataclasses.replace(ctx, config=checkpoint.loading_config(ctx.config))
        cfg, scheme = checkpoint.model_config(), parse_quantization(ctx.config)
        return build_and_load(
            lambda: KimiK2ForCausalLM(
                cfg, ctx.parallel, ctx.expert_parallel, ctx.data_parallel, scheme,
                checkpoint.weight_prefix,
            ),
            ctx,
        )  # fmt: skip

    def load_tokenizer(self, tokenizer_dir: Path) -> Tokenizer:
        return load_kimi_tokenizer(tokenizer_dir)

    def write_tiny_checkpoint(
        self, out_dir: Path, *, seed: int = 0, num_shards: int = 1, **overrides: Any
    ) -> None:
        from pegainfer.models.kimi_k2.tiny import write_tiny_kimi

        write_tiny_kimi(out_dir, seed=seed, num_shards=num_shards, **overrides)
