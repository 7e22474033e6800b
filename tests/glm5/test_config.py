"""GLM-5's config: each layer's indexer as transformers derives it from any of the fields a
checkpoint may carry, and the refusals."""

from __future__ import annotations

import pytest
import transformers

from pegainfer.core.errors import ConfigError
from pegainfer.models.glm5.config import Glm5Config
from tests.glm5.hf_reference import SMALL

LAYERS = 9


def config(**fields) -> dict:
    return SMALL | {"num_hidden_layers": LAYERS, "model_type": "glm_moe_dsa"} | fields


@pytest.mark.parametrize("fields", [
    {},
    {"index_topk_freq": 4},
    {"index_topk_freq": 3, "index_skip_topk_offset": 4},
    {"index_topk_pattern": "FFFSSSFSF"},
    {"indexer_types": ["full", "shared"] * 4 + ["full"]},
], ids=["default", "freq", "freq-offset", "pattern", "explicit"])  # fmt: skip
def test_indexer_types_are_transformers(fields):
    """transformers reads the pattern from these fields only as constructor arguments (its
    saved config then lists `indexer_types`); a published config may carry any of them."""
    hf = transformers.GlmMoeDsaConfig(**{k: v for k, v in config(**fields).items()
                                         if k != "model_type"})  # fmt: skip
    ours = Glm5Config.from_dict(config(**fields))
    assert list(ours.indexer_types) == hf.indexer_types
    assert ours.full_indexer_layers == [i for i, t in enumerate(hf.indexer_types) if t == "full"]


@pytest.mark.parametrize(("fields", "message"), [
    ({"index_topk_pattern": "SFFFFFFFF"}, "the first one 'full'"),
    ({"indexer_types": ["full"] * 3}, "each layer"),
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"mlp_layer_types": ["sparse"] * LAYERS}, "mlp_layer_types"),
    ({"topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False}, "noaux_tc"),
])  # fmt: skip
def test_configs_we_cannot_run_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        Glm5Config.from_dict(config(**fields))
