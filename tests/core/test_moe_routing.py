"""Routing (`core.moe.routing.route`) picks transformers' experts with transformers' weights:
DeepSeek-V2's softmax routers and DeepSeek-V3's noaux_tc one (sigmoid, correction bias, group
stage, renormalised, scaled)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from pegainfer.core.errors import ConfigError
from pegainfer.core.moe.routing import Routing, route

HIDDEN, EXPERTS, TOKENS = 32, 16, 200


def sorted_by_expert(weights: torch.Tensor, experts: torch.Tensor):
    order = experts.argsort(dim=1)
    return weights.gather(1, order), experts.gather(1, order)


def assert_same_routing(ours, theirs):
    ours_w, ours_e = sorted_by_expert(*ours)
    theirs_w, theirs_e = sorted_by_expert(*theirs)
    assert torch.equal(ours_e, theirs_e)
    torch.testing.assert_close(ours_w, theirs_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("n_group", "topk_group", "normalize", "scaling"),
    [(1, 1, True, 2.827), (4, 2, True, 2.5), (8, 3, False, 1.0)],
    ids=["kimi", "v3-grouped", "unnormalised"],
)
def test_noaux_tc_equals_deepseek_v3s_router(n_group, topk_group, normalize, scaling):
    config = {"n_routed_experts": EXPERTS, "num_experts_per_tok": 4, "scoring_func": "sigmoid",
              "topk_method": "noaux_tc", "n_group": n_group, "topk_group": topk_group,
              "norm_topk_prob": normalize, "routed_scaling_factor": scaling}  # fmt: skip
    hf_config = transformers.DeepseekV3Config(hidden_size=HIDDEN, **config)
    torch.manual_seed(n_group)
    router = DeepseekV3TopkRouter(hf_config)
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
        router.e_score_correction_bias.normal_(0, 0.5)  # transformers leaves it at 0
    x = torch.randn(TOKENS, HIDDEN)
    routing = Routing.from_dict(config)
    ours = route(x, router.weight, routing, router.e_score_correction_bias)
    _, theirs_w, theirs_e = router(x)
    assert_same_routing(ours, (theirs_w, theirs_e))
    # The bias changes the choice, but the weights are the plain sigmoid scores.
    plain = route(x, router.weight, routing, torch.zeros(EXPERTS))
    assert not torch.equal(plain[1].sort(dim=1).values, ours[1].sort(dim=1).values)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_softmax_routing_equals_deepseek_v2s_router(method):
    config = {"n_routed_experts": EXPERTS, "num_experts_per_tok": 3, "topk_method": method,
              "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5}  # fmt: skip
    hf_config = transformers.DeepseekV2Config(hidden_size=HIDDEN, **config)
    torch.manual_seed(0)
    router = DeepseekV2TopkRouter(hf_config)
    with torch.no_grad():
        router.weight.normal_(0, 1.0)
    x = torch.randn(TOKENS, HIDDEN)
    _, theirs_w, theirs_e = router(x)
    assert_same_routing(route(x, router.weight, Routing.from_dict(config)), (theirs_w, theirs_e))


def test_bad_routing_configs_are_refused():
    base = {"n_routed_experts": 16, "num_experts_per_tok": 2}
    with pytest.raises(ConfigError, match="scoring_func 'sigmoid' and topk_method 'greedy'"):
        Routing.from_dict(base | {"scoring_func": "sigmoid"})
    with pytest.raises(ConfigError, match="norm_topk_prob with softmax"):
        Routing.from_dict(base | {"norm_topk_prob": True})
    with pytest.raises(ConfigError, match="not a valid grouping"):
        Routing.from_dict(base | {"scoring_func": "sigmoid", "topk_method": "noaux_tc",
                                  "n_group": 3})  # fmt: skip
    routing = Routing.from_dict(base | {"scoring_func": "sigmoid", "topk_method": "noaux_tc"})
    with pytest.raises(ValueError, match="correction bias"):
        route(torch.randn(2, 8), torch.randn(16, 8), routing)
