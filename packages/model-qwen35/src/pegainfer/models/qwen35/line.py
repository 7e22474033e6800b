"""The Qwen3.5 line: claims `qwen3_5` (VLM) and `qwen3_5_text` checkpoints, serves their text."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pegainfer.core.errors import ConfigError
from pegainfer.core.model_line import ModelLine, Probe

if TYPE_CHECKING:
    from pegainfer.core.kernels.precompile import KernelPlan, StepBounds
    from pegainfer.core.model import Model, ModelContext
    from pegainfer.core.runner.model_runner import ModelRunner
    from pegainfer.core.speculative.drafter import Drafter

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")


class Qwen35Line(ModelLine):
    name = "qwen35"
    unsupported_args = frozenset({"enable_expert_parallel"})  # no experts
    reasoning_parser = "qwen3"  # <think>…</think>
    tool_call_parser = "qwen3_xml"

    def probe(self, config: dict[str, Any]) -> Probe:
        model_type = config.get("model_type")
        if model_type in MODEL_TYPES:
            return Probe.claim()
        return Probe.reject(f"model_type is {model_type!r}, not one of {MODEL_TYPES}")

    def build_model(self, ctx: ModelContext) -> Model:
        from pegainfer.core.loading.weights import build_and_load
        from pegainfer.models.qwen35.config import Qwen35Config
        from pegainfer.models.qwen35.model import Qwen35ForCausalLM

        cfg = Qwen35Config.from_dict(ctx.config)
        return build_and_load(lambda: Qwen35ForCausalLM(cfg, ctx.parallel), ctx)

    def build_drafter(
        self, model: Model, ctx: ModelContext, num_tokens: int, runner: ModelRunner
    ) -> Drafter | None:
        """The checkpoint's MTP layer (`mtp.*`), loaded beside the model."""
        from pegainfer.core.loading.weights import build_and_load
        from pegainfer.core.speculative.mtp import MTPDrafter
        from pegainfer.models.qwen35.mtp import Qwen35MTP

        cfg = model.cfg
        if not cfg.mtp_num_hidden_layers:
            return None
        if cfg.mtp_num_hidden_layers != 1:
            raise ConfigError(
                f"the checkpoint has {cfg.mtp_num_hidden_layers} MTP layers; the qwen35 line "
                "drafts with one (mtp_num_hidden_layers 1)"
            )
        mtp = build_and_load(lambda: Qwen35MTP(cfg, model), ctx)
        model.attach_mtp(mtp)
        return MTPDrafter(mtp, runner, num_tokens)

    def kernel_plan(self, ctx: ModelContext, bounds: StepBounds) -> KernelPlan:
        from pegainfer.core.loading.weights import meta_model
        from pegainfer.core.runner.meta_steps import paged_kernel_plan
        from pegainfer.models.qwen35.config import Qwen35Config
        from pegainfer.models.qwen35.model import Qwen35ForCausalLM

        # A layer of each kind launches what every layer of that kind does.
        cfg = Qwen35Config.from_dict(ctx.config)
        cfg = replace(cfg, layer_types=tuple(dict.fromkeys(cfg.layer_types)))
        model = meta_model(lambda: Qwen35ForCausalLM(cfg, ctx.parallel), ctx.dtype)
        return paged_kernel_plan(model, ctx.dtype, ctx.device, bounds)

    def write_tiny_checkpoint(
        self, out_dir: Path, *, seed: int = 0, num_shards: int = 1, **overrides: Any
    ) -> None:
        from pegainfer.models.qwen35.tiny import write_tiny_qwen35

        write_tiny_qwen35(out_dir, seed=seed, num_shards=num_shards, **overrides)
