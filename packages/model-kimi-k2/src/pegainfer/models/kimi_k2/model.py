"""Kimi-K2's model: core's latent-attention MoE decoder, reading a vision-language checkpoint's
text weights (K2.5, K2.6) under their prefix and leaving its vision tower and projector."""

from __future__ import annotations

from pegainfer.core.distributed import parallel
from pegainfer.core.latent_moe.config import LatentMoEConfig
from pegainfer.core.latent_moe.model import LatentMoEForCausalLM
from pegainfer.core.loading.weights import WeightTarget

# A vision-language checkpoint's tensors that text serving does not read.
_VISION_PREFIXES = ("vision_tower.", "mm_projector.")


class KimiK2ForCausalLM(LatentMoEForCausalLM):
    def __init__(
        self, cfg: LatentMoEConfig, weight_prefix: str = "",
        group: parallel.ParallelGroup | None = None, expert_parallel: bool = False,
        data_parallel: parallel.ParallelGroup | None = None,
    ) -> None:  # fmt: skip
        super().__init__(cfg, group, expert_parallel, data_parallel)
        self.weight_prefix = weight_prefix

    def checkpoint_name_map(self, name: str) -> WeightTarget | list[WeightTarget] | None:
        if self.weight_prefix:
            if name.startswith(_VISION_PREFIXES):
                return None
            if not name.startswith(self.weight_prefix):
                return WeightTarget(name)  # neither text nor vision: the loader reports it
            name = name.removeprefix(self.weight_prefix)
        return super().checkpoint_name_map(name)
