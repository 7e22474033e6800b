"""The GLM-5 line: claims `model_type: glm_moe_dsa` checkpoints (GLM-5, 5.1, 5.2), built on
core's latent-attention MoE decoder with DeepSeek sparse attention."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pegainfer.core.model_line import ModelLine, Probe

if TYPE_CHECKING:
    from pegainfer.core.model import Model, ModelContext
    from pegainfer.core.runner.model_runner import ModelRunner
    from pegainfer.core.speculative.drafter import Drafter


class Glm5Line(ModelLine):
    name = "glm5"
    unsupported_args = frozenset({"state_checkpoints"})  # no recurrent layers
    supports_data_parallel = True
    reasoning_parser = "glm45"  # thinking from the answer's start, until </think>
    tool_call_parser = "glm47"  # <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…

    def probe(self, config: dict[str, Any]) -> Probe:
        model_type = config.get("model_type")
        if model_type == "glm_moe_dsa":
            return Probe.claim()
        return Probe.reject(f"model_type is {model_type!r}, not 'glm_moe_dsa'")

    def build_model(self, ctx: ModelContext) -> Model:
        from pegainfer.core.loading.weights import build_and_load
        from pegainfer.core.quant.scheme import parse_quantization
        from pegainfer.models.glm5.config import Glm5Config
        from pegainfer.models.glm5.model import Glm5ForCausalLM

        cfg, scheme = Glm5Config.from_dict(ctx.config), parse_quantization(ctx.config)
        return build_and_load(
            lambda: Glm5ForCausalLM(
                cfg, ctx.parallel, ctx.expert_parallel, ctx.data_parallel, scheme
            ),
            ctx,
        )

    def build_drafter(
        self, model: Model, ctx: ModelContext, num_tokens: int, runner: ModelRunner
    ) -> Drafter | None:
        """The checkpoint's MTP layer (`model.layers.{num_hidden_layers}.*`), loaded beside the
        model."""
        from pegainfer.core.loading.weights import build_and_load
        from pegainfer.core.speculative.mtp import MTPDrafter
        from pegainfer.models.glm5.mtp import Glm5MTP

        if not model.cfg.mtp_layers:
            return None
        mtp = build_and_load(lambda: Glm5MTP(model.cfg, model, ctx.expert_parallel), ctx)
        mtp.after_loading()
        model.attach_mtp(mtp)
        return MTPDrafter(mtp, runner, num_tokens)

    def write_tiny_checkpoint(
        self, out_dir: Path, *, seed: int = 0, num_shards: int = 1, **overrides: Any
    ) -> None:
        from pegainfer.models.glm5.tiny import write_tiny_glm5

        # GLM-5's MTP layer too, unless told otherwise (`make-checkpoint`'s shapes leave it out).
        overrides = {"num_nextn_predict_layers": 1} | overrides
        write_tiny_glm5(out_dir, seed=seed, num_shards=num_shards, **overrides)
