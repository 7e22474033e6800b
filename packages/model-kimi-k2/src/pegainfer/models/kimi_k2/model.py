"""Kimi-K2's model: core's latent-attention MoE decoder, reading a vision-language checkpoint's
text weights (K2.5, K2.6) under their prefix (`checkpoint_prefix`) and leaving its vision tower
and projector."""

from __future__ import annotations

from pegainfer.core.latent_moe.model import LatentMoEForCausalLM
from pegainfer.core.loading.weights import WeightTarget

# A vision-language checkpoint's tensors that text serving does not read.
_VISION_PREFIXES = ("vision_tower.", "mm_projector.")


class KimiK2ForCausalLM(LatentMoEForCausalLM):
    def checkpoint_name_map(self, name: str) -> WeightTarget | list[WeightTarget] | None:
        prefix = self.checkpoint_prefix
        if prefix:
            if name.startswith(_VISION_PREFIXES):
                return None
            if not name.startswith(prefix):
                return WeightTarget(name)  # neither text nor vision: the loader reports it
            name = name.removeprefix(prefix)
        return super().checkpoint_name_map(name)
