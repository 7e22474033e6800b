"""The Kimi-K2 line: claims `kimi_k2` and `deepseek_v3` checkpoints and the text model of
`kimi_k25` (K2.5, K2.6) ones, built on core's latent-attention MoE decoder."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pegainfer.core.errors import ConfigError
from pegainfer.core.model_line import ModelLine, Probe
from pegainfer.core.text.tokenizer import Tokenizer, chat_template_sources
from pegainfer.models.kimi_k2.config import KimiCheckpoint
from pegainfer.models.kimi_k2.tokenizer import TIKTOKEN_FILE, load_kimi_tokenizer

if TYPE_CHECKING:
    from pegainfer.core.kernels.precompile import KernelPlan, StepBounds
    from pegainfer.core.model import Model, ModelContext

_JINJA_COMMENT = re.compile(r"\{#.*?#\}", re.DOTALL)


class KimiK2Line(ModelLine):
    name = "kimi-k2"
    unsupported_args = frozenset({"state_checkpoints"})  # no recurrent layers
    supports_data_parallel = True
    tokenizer_file = TIKTOKEN_FILE
    tool_call_parser = "kimi_k2"  # Kimi's calls in special tokens

    def reasoning_parser_for(self, config: dict[str, Any], tokenizer_dir: Path) -> str | None:
        """kimi_k2 for the checkpoints that think: K2.5 and K2.6 (`kimi_k25`), and those whose
        chat template writes thinking into the assistant turns (K2-Thinking's); none for
        K2-Instruct, whose answers kimi_k2's split would read as thinking from the first token."""
        if config.get("model_type") == "kimi_k25":
            return "kimi_k2"
        templates = [
            _JINJA_COMMENT.sub("", t) for t in chat_template_sources(tokenizer_dir).values()
        ]
        return "kimi_k2" if any("</think>" in template for template in templates) else None

    def probe(self, config: dict[str, Any]) -> Probe:
        checkpoint = KimiCheckpoint.of(config)
        if isinstance(checkpoint, str):
            return Probe.reject(checkpoint)
        return Probe.claim()

    def build_model(self, ctx: ModelContext) -> Model:
        from pegainfer.core.loading.weights import build_and_load

        ctx, make = self._model_maker(ctx)
        return build_and_load(make, ctx)

    def kernel_plan(self, ctx: ModelContext, bounds: StepBounds) -> KernelPlan:
        from pegainfer.core.loading.weights import meta_model
        from pegainfer.core.runner.meta_steps import latent_kernel_plan

        # A dense layer and a MoE layer launch what every layer of their kind does.
        ctx, make = self._model_maker(ctx, layers_of_each_kind=True)
        return latent_kernel_plan(meta_model(make, ctx.dtype), ctx.dtype, ctx.device, bounds)

    @staticmethod
    def _model_maker(
        ctx: ModelContext, layers_of_each_kind: bool = False
    ) -> tuple[ModelContext, Callable[[], Model]]:
        """The context to load `ctx`'s checkpoint in (its config as the loader reads it) and
        the function that builds its model (with `layers_of_each_kind`: a dense and a MoE
        layer only)."""
        from pegainfer.core.quant.scheme import parse_quantization
        from pegainfer.models.kimi_k2.model import KimiK2ForCausalLM

        checkpoint = KimiCheckpoint.of(ctx.config)
        if isinstance(checkpoint, str):
            raise ConfigError(checkpoint)
        ctx = dataclasses.replace(ctx, config=checkpoint.loading_config(ctx.config))
        cfg, scheme = checkpoint.model_config(), parse_quantization(ctx.config)
        if layers_of_each_kind:
            cfg = dataclasses.replace(
                cfg, num_layers=min(cfg.num_layers, cfg.first_k_dense_replace + 1)
            )
        return ctx, lambda: KimiK2ForCausalLM(
            cfg, ctx.parallel, ctx.expert_parallel, ctx.data_parallel, scheme,
            checkpoint.weight_prefix,
        )  # fmt: skip

    def load_tokenizer(self, tokenizer_dir: Path) -> Tokenizer:
        return load_kimi_tokenizer(tokenizer_dir)

    def write_tiny_checkpoint(
        self, out_dir: Path, *, seed: int = 0, num_shards: int = 1, **overrides: Any
    ) -> None:
        from pegainfer.models.kimi_k2.tiny import write_tiny_kimi

        write_tiny_kimi(out_dir, seed=seed, num_shards=num_shards, **overrides)
