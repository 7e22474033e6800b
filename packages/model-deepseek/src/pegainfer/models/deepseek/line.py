"""The DeepSeek line: claims `model_type: deepseek_v2` checkpoints (DeepSeek-V2, V2-Lite), built
on core's latent-attention MoE decoder."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pegainfer.core.errors import ConfigError
from pegainfer.core.model_line import ModelLine, Probe

if TYPE_CHECKING:
    from pegainfer.core.kernels.precompile import KernelPlan, StepBounds
    from pegainfer.core.latent_moe.config import LatentMoEConfig
    from pegainfer.core.model import Model, ModelContext


def deepseek_v2_config(config: dict[str, Any]) -> LatentMoEConfig:
    """DeepSeek-V2's config: softmax routing (greedy or group-limited) only."""
    from pegainfer.core.latent_moe.config import LatentMoEConfig

    cfg = LatentMoEConfig.from_dict(config)
    if cfg.routing.scoring != "softmax":
        raise ConfigError("DeepSeek-V2 routes by softmax scores (scoring_func 'softmax')")
    return cfg


class DeepseekLine(ModelLine):
    name = "deepseek"
    unsupported_args = frozenset({"state_checkpoints"})  # no recurrent layers
    supports_data_parallel = True

    def probe(self, config: dict[str, Any]) -> Probe:
        model_type = config.get("model_type")
        if model_type == "deepseek_v2":
            return Probe.claim()
        return Probe.reject(f"model_type is {model_type!r}, not 'deepseek_v2'")

    def build_model(self, ctx: ModelContext) -> Model:
        from pegainfer.core.latent_moe.model import LatentMoEForCausalLM
        from pegainfer.core.loading.weights import build_and_load

        cfg = deepseek_v2_config(ctx.config)
        return build_and_load(
            lambda: LatentMoEForCausalLM(cfg, ctx.parallel, ctx.expert_parallel, ctx.data_parallel),
            ctx,
        )

    def kernel_plan(self, ctx: ModelContext, bounds: StepBounds) -> KernelPlan:
        from dataclasses import replace

        from pegainfer.core.latent_moe.model import LatentMoEForCausalLM
        from pegainfer.core.loading.weights import meta_model
        from pegainfer.core.runner.meta_steps import latent_kernel_plan

        # A dense layer and a MoE layer launch what every layer of their kind does.
        cfg = deepseek_v2_config(ctx.config)
        cfg = replace(cfg, num_layers=min(cfg.num_layers, cfg.first_k_dense_replace + 1))
        model = meta_model(lambda: LatentMoEForCausalLM(cfg, ctx.parallel, ctx.expert_parallel,
                                                        ctx.data_parallel), ctx.dtype)  # fmt: skip
        return latent_kernel_plan(model, ctx.dtype, ctx.device, bounds)

    def write_tiny_checkpoint(
        self, out_dir: Path, *, seed: int = 0, num_shards: int = 1, **overrides: Any
    ) -> None:
        from pegainfer.models.deepseek.tiny import write_tiny_deepseek

        write_tiny_deepseek(out_dir, seed=seed, num_shards=num_shards, **overrides)
