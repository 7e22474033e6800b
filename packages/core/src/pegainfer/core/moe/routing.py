"""How a token picks its experts (the torch reference; CUDA kernels in `moe.kernels`), as
configured by a checkpoint's `scoring_func` and `topk_method`:

- `softmax` + `greedy` (DeepSeek-V2-Lite): softmax over every expert's router logit, the top k,
  weights = those probabilities x `routed_scaling_factor` (never renormalised);
- `softmax` + `group_limited_greedy` (DeepSeek-V2): likewise among the experts of the best
  `topk_group` of `n_group` groups, a group scored by its best expert;
- `sigmoid` + `noaux_tc` (DeepSeek-V3, Kimi-K2, GLM-5): s = sigmoid(logit), the choice made on
  s + `e_score_correction_bias` within the best `topk_group` groups (a group scored by the sum
  of its two best biased scores), weights gathered from the unbiased s, renormalised when
  `norm_topk_prob` (sum + 1e-20), x `routed_scaling_factor`.

All in float32 from the router logits on, as transformers computes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pegainfer.core.errors import ConfigError

# (scoring_func, topk_method) pairs we route by.
_METHODS = {("softmax", "greedy"), ("softmax", "group_limited_greedy"), ("sigmoid", "noaux_tc")}


@dataclass(frozen=True)
class Routing:
    num_experts: int
    top_k: int
    scoring: str = "softmax"
    method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    normalize: bool = False
    scaling: float = 1.0

    @property
    def corrected(self) -> bool:
        """Whether the router carries an `e_score_correction_bias` (noaux_tc)."""
        return self.method == "noaux_tc"

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Routing:
        scoring = config.get("scoring_func", "softmax")
        method = config.get("topk_method", "greedy")
        if (scoring, method) not in _METHODS:
            raise ConfigError(
                f"routing with scoring_func {scoring!r} and topk_method {method!r} is not "
                f"supported (one of {sorted(_METHODS)})"
            )
        normalize = bool(config.get("norm_topk_prob", False))
        if normalize and scoring == "softmax":
            # transformers' DeepSeek-V2 never renormalises; neither do we, so refuse the flag.
            raise ConfigError("norm_topk_prob with softmax scoring is not supported")
        routing = cls(
            num_experts=int(config["n_routed_experts"]),
            top_k=int(config["num_experts_per_tok"]),
            scoring=scoring,
            method=method,
            n_group=int(config.get("n_group") or 1),
            topk_group=int(config.get("topk_group") or 1),
            normalize=normalize,
            scaling=float(config.get("routed_scaling_factor") or 1.0),
        )
        if routing.num_experts % routing.n_group or routing.topk_group > routing.n_group:
            raise ConfigError(
                f"{routing.num_experts} experts in {routing.n_group} groups, "
                f"{routing.topk_group} kept: not a valid grouping"
            )
        return routing


def _keep_best_groups(group_scores: torch.Tensor, topk_group: int) -> torch.Tensor:
    """[T, groups] -> a bool mask of the `topk_group` best groups of each row."""
    best = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    return torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)


def route(
    x: torch.Tensor,
    gate: torch.Tensor,
    routing: Routing,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route the tokens x [T, H] by the router matrix `gate` [E, H] (and, for noaux_tc, its
    `correction_bias` [E]). Returns (weights [T, k] float32, experts [T, k] int64), in no
    particular order within a row."""
    if routing.corrected != (correction_bias is not None):
        raise ValueError(f"{routing.method} routing takes a correction bias iff it is noaux_tc")
    logits = F.linear(x.float(), gate.float())
    tokens, groups = logits.shape[0], routing.n_group
    if routing.scoring == "softmax":
        scores = logits.softmax(dim=-1)
        if routing.method == "group_limited_greedy":
            grouped = scores.view(tokens, groups, -1)
            keep = _keep_best_groups(grouped.max(dim=-1).values, routing.topk_group)
            scores = scores.masked_fill(~keep[..., None].expand_as(grouped).flatten(1), 0.0)
        weights, experts = scores.topk(routing.top_k, dim=-1, sorted=False)
        return weights * routing.scaling, experts
    scores = logits.sigmoid()
    choice = scores + correction_bias.float()
    if groups > 1:
        grouped = choice.view(tokens, groups, -1)
        keep = _keep_best_groups(grouped.topk(2, dim=-1).values.sum(dim=-1), routing.topk_group)
        choice = choice.masked_fill(~keep[..., None].expand_as(grouped).flatten(1), -torch.inf)
    experts = choice.topk(routing.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, experts)
    if routing.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scaling, experts
