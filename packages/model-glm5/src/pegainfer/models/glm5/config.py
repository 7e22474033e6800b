"""GLM-5's configuration (`model_type: glm_moe_dsa`, models.md section 2.5): core's
latent-attention MoE decoder (q-LoRA MLA, dense first layers, sigmoid + correction-bias routing)
plus DeepSeek sparse attention's lightning indexer, run in every `full` layer of
`indexer_types` (GLM-5.2's `shared` layers reuse the previous full layer's selection)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pegainfer.core.errors import ConfigError
from pegainfer.core.latent_moe.config import LatentMoEConfig


@dataclass(frozen=True, kw_only=True)
class Glm5Config(LatentMoEConfig):
    index_heads: int
    index_head_dim: int
    index_topk: int
    #: Per layer: whether it runs its own indexer ("full") or reuses the last one's ("shared").
    indexer_types: tuple[str, ...]

    @property
    def index_scale(self) -> float:
        """The scale inside the indexer's ReLU (its head dim's inverse square root)."""
        return self.index_head_dim**-0.5

    @property
    def full_indexer_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.indexer_types) if kind == "full"]

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Glm5Config:
        # transformers' GLM-5 always routes so and writes neither field; published configs do.
        config = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"} | config
        base = LatentMoEConfig.from_dict(config)
        if base.q_lora_rank is None:
            raise ConfigError("GLM-5's indexer reads the q LoRA: q_lora_rank must be set")
        if base.routing.method != "noaux_tc":
            raise ConfigError("GLM-5 routes by sigmoid scores with a correction bias (noaux_tc)")
        layers = base.num_layers
        dense = base.first_k_dense_replace
        expected_mlp = ["dense"] * dense + ["sparse"] * (layers - dense)
        if list(config.get("mlp_layer_types") or expected_mlp) != expected_mlp:
            raise ConfigError(
                "mlp_layer_types must be first_k_dense_replace dense layers, then MoE layers"
            )
        kinds = _indexer_types(config, layers)
        if len(kinds) != layers or set(kinds) - {"full", "shared"} or kinds[0] != "full":
            raise ConfigError(
                "indexer_types must give each layer 'full' or 'shared', the first one 'full'"
            )
        index_dim = int(config.get("index_head_dim", 128))
        if index_dim < base.qk_rope_head_dim:
            raise ConfigError("the indexer's head dim must hold its rope dims")
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        return cls(
            **fields,
            index_heads=int(config.get("index_n_heads", 32)),
            index_head_dim=index_dim,
            index_topk=int(config.get("index_topk", 2048)),
            indexer_types=kinds,
        )


def _indexer_types(config: dict[str, Any], layers: int) -> tuple[str, ...]:
    """Each layer's indexer, as transformers' `GlmMoeDsaConfig` derives it: `indexer_types`;
    else `index_topk_pattern` ("F"/"S" per layer); else every `index_topk_freq`-th layer
    from `index_skip_topk_offset` - 1 on runs its own (the layers before it all do)."""
    if config.get("indexer_types") is not None:
        return tuple(config["indexer_types"])
    pattern = config.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            return tuple({"F": "full", "S": "shared"}.get(c, c) for c in pattern)
        return tuple(pattern)
    freq = max(int(config.get("index_topk_freq", 1)), 1)
    offset = int(config.get("index_skip_topk_offset", 2))
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                 for i in range(layers))  # fmt: skip
