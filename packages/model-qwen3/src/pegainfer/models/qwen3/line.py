"""The Qwen3 model line: claims `model_type: qwen3` checkpoints and builds their model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pegainfer.core.model_line import ModelLine, Probe

if TYPE_CHECKING:
    from pegainfer.core.kernels.precompile import KernelPlan, StepBounds
    from pegainfer.core.model import Model, ModelContext


class Qwen3Line(ModelLine):
    name = "qwen3"
    reasoning_parser = "qwen3"  # <think>…</think>
    tool_call_parser = "hermes"
    # No recurrent layers, no experts.
    unsupported_args = frozenset({"state_checkpoints", "enable_expert_parallel"})

    def probe(self, config: dict[str, Any]) -> Probe:
        model_type = config.get("model_type")
        if model_type == "qwen3":
            return Probe.claim()
        return Probe.reject(f"model_type is {model_type!r}, not 'qwen3'")

    def build_model(self, ctx: ModelContext) -> Model:
        from pegainfer.core.loading.weights import build_and_load
        from pegainfer.core.quant.scheme import parse_quantization
        from pegainfer.models.qwen3.config import Qwen3Config
        from pegainfer.models.qwen3.model import Qwen3ForCausalLM

        cfg = Qwen3Config.from_dict(ctx.config)
        scheme = parse_quantization(ctx.config)
        return build_and_load(lambda: Qwen3ForCausalLM(cfg, ctx.parallel, scheme), ctx)

    def kernel_plan(self, ctx: ModelContext, bounds: StepBounds) -> KernelPlan:
        from pegainfer.core.loading.weights import meta_model
        from pegainfer.core.quant.scheme import parse_quantization
        from pegainfer.core.runner.meta_steps import paged_kernel_plan
        from pegainfer.models.qwen3.config import Qwen3Config
        from pegainfer.models.qwen3.model import Qwen3ForCausalLM

        # One layer launches what every layer does.
        cfg = replace(Qwen3Config.from_dict(ctx.config), num_layers=1)
        scheme = parse_quantization(ctx.config)
        model = meta_model(lambda: Qwen3ForCausalLM(cfg, ctx.parallel, scheme), ctx.dtype)
        return paged_kernel_plan(model, ctx.dtype, ctx.device, bounds)

    def write_tiny_checkpoint(
        self, out_dir: Path, *, seed: int = 0, num_shards: int = 1, **overrides: Any
    ) -> None:
        from pegainfer.models.qwen3.tiny import write_tiny_qwen3

        write_tiny_qwen3(out_dir, seed=seed, num_shards=num_shards, **overrides)
