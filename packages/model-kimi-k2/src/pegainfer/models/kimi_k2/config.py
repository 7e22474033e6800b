"""Kimi-K2's checkpoints (models.md section 2.4): the DeepSeek-V3 decoder (q-LoRA MLA, YaRN with
V3's mscale, a dense first layer, noaux_tc routing over 384 experts plus a shared one), as
`model_type` `kimi_k2` (Kimi-K2-Instruct, -Thinking) or `deepseek_v3` (DeepSeek-V3 and any
checkpoint of that architecture). K2.5 and K2.6 (`kimi_k25`) are vision-language checkpoints:
their text model's config sits under `text_config` and its weights under `language_model.`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pegainfer.core.errors import ConfigError

if TYPE_CHECKING:  # it imports torch: the probe, which the HTTP server runs, needs none
    from pegainfer.core.latent_moe.config import LatentMoEConfig

TEXT_MODEL_TYPES = ("kimi_k2", "deepseek_v3")
VISION_LANGUAGE_MODEL_TYPE = "kimi_k25"
# Where a vision-language checkpoint keeps its text model's tensors.
TEXT_WEIGHT_PREFIX = "language_model."
# DeepSeek-V3's routing, which transformers' DeepseekV3Config assumes and does not write.
V3_ROUTING = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True}


@dataclass(frozen=True)
class KimiCheckpoint:
    """The text model of a checkpoint: its config, and the prefix of its tensors' names."""

    text_config: dict[str, Any]
    weight_prefix: str = ""

    @classmethod
    def of(cls, config: dict[str, Any]) -> KimiCheckpoint | str:
        """The text model of a Kimi-K2 / DeepSeek-V3 checkpoint, or why `config` is not one."""
        model_type = config.get("model_type")
        if model_type in TEXT_MODEL_TYPES:
            return cls(config)
        if model_type == VISION_LANGUAGE_MODEL_TYPE:
            text = config.get("text_config")
            if not isinstance(text, dict) or text.get("model_type") not in TEXT_MODEL_TYPES:
                return f"a {model_type!r} checkpoint without a DeepSeek-V3 text_config"
            return cls(text, TEXT_WEIGHT_PREFIX)
        accepted = [*TEXT_MODEL_TYPES, VISION_LANGUAGE_MODEL_TYPE]
        return f"model_type is {model_type!r}, not one of {accepted}"

    def loading_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's `config` as the loader reads it: with the text model's
        `quantization_config` where the checkpoint keeps it there (K2.5, K2.6) rather than at
        the top."""
        nested = self.text_config.get("quantization_config")
        if nested is None or "quantization_config" in config:
            return config
        return config | {"quantization_config": nested}

    def model_config(self) -> LatentMoEConfig:
        from pegainfer.core.latent_moe.config import LatentMoEConfig

        written = {key: value for key, value in self.text_config.items() if value is not None}
        cfg = LatentMoEConfig.from_dict(V3_ROUTING | written)
        if cfg.routing.method != "noaux_tc":
            raise ConfigError(
                f"a DeepSeek-V3 checkpoint routes by noaux_tc, not {cfg.routing.method!r}"
            )
        return cfg
