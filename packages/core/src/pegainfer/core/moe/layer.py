"""The MoE MLP as model lines build it: a router, routed experts held stacked (`RoutedExperts`,
handed to the compute as `ExpertWeights`), always-on shared experts; and the SwiGLU MLPs
(shared experts, dense layers) beside it.

Under tensor parallelism a rank holds its share of every routed expert's width (the default:
every rank reads a share of each chosen expert) or, with `expert_parallel`, a range of whole
experts; and its share of the shared ones' width. Either way every rank routes every token and
one all-reduce sums routed and shared outputs. With data-parallel attention (`data_parallel`
of more than one rank) a rank holds a range of whole experts and the whole shared ones, and
routes only its own tokens, which the all-to-all (`core.distributed.expert_parallel`) takes to
their experts' ranks and back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pegainfer.core.distributed import expert_parallel, parallel
from pegainfer.core.layer_ops import LayerOps
from pegainfer.core.loading.weights import empty_param
from pegainfer.core.moe.experts import ExpertWeights
from pegainfer.core.moe.routing import Routing, route


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused in one matrix [2I, H]."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = empty_param(2 * inter, hidden)
        self.down_proj = empty_param(hidden, inter)

    def forward(self, x: torch.Tensor, elementwise: LayerOps) -> torch.Tensor:
        h = elementwise.silu_and_mul(F.linear(x, self.gate_up_proj))
        return F.linear(h, self.down_proj)


class DenseMLP(SwiGLU):
    """A dense layer's SwiGLU MLP, its width split over the ranks."""

    def __init__(self, hidden: int, inter: int, group: parallel.ParallelGroup) -> None:
        super().__init__(hidden, inter)
        self.group = group

    def forward(self, x: torch.Tensor, elementwise: LayerOps) -> torch.Tensor:
        h = elementwise.silu_and_mul(F.linear(x, self.gate_up_proj))
        return parallel.row_parallel_linear(h, self.down_proj, self.group)


class RoutedExperts(nn.Module):
    """This rank's routed experts, `first`.. `first + count - 1`, stacked: `gate_up_proj`
    holds expert i's fused gate/up rows at [i * 2I, (i + 1) * 2I), `down_proj` its down rows
    at [i * H, (i + 1) * H) (2-D, so the loader fills each expert's rows like any fused
    matrix's; `weights()` gives the [experts, ...] views the compute reads). `width`: the
    [start, end) of each expert's intermediate features held here (None: all of them)."""

    def __init__(
        self, hidden: int, inter: int, count: int, first: int,
        width: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.hidden, self.inter, self.count, self.first = hidden, inter, count, first
        self.width = width
        self.gate_up_proj = empty_param(count * 2 * inter, hidden)
        self.down_proj = empty_param(count * hidden, inter)

    def weights(self) -> ExpertWeights:
        return ExpertWeights(
            self.gate_up_proj.view(self.count, 2 * self.inter, self.hidden),
            self.down_proj.view(self.count, self.hidden, self.inter),
            self.first,
        )


class MoE(nn.Module):
    """Routed experts beside always-on shared ones (`num_shared` of width `inter`, fused in
    one MLP), routed by `routing` (module docstring: how the ranks divide them)."""

    def __init__(
        self, hidden: int, inter: int, num_shared: int, routing: Routing,
        group: parallel.ParallelGroup, expert_parallel: bool,
        data_parallel: parallel.ParallelGroup,
    ) -> None:  # fmt: skip
        super().__init__()
        self.routing = routing
        self.group = group
        self.data_parallel = data_parallel
        num_experts = routing.num_experts
        self.gate = empty_param(num_experts, hidden)
        self.e_score_correction_bias = (
            empty_param(num_experts, dtype=torch.float32) if routing.corrected else None
        )
        if data_parallel.world_size > 1:
            local = num_experts // data_parallel.world_size
            self.experts = RoutedExperts(hidden, inter, local, data_parallel.rank * local)
        elif expert_parallel:
            local = num_experts // group.world_size
            self.experts = RoutedExperts(hidden, inter, local, group.rank * local)
        else:
            width = group.split(inter)
            self.experts = RoutedExperts(hidden, width[1] - width[0], num_experts, 0, width)
        self.shared_experts = SwiGLU(hidden, inter * num_shared // group.world_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, experts [T, k]) of the tokens x [T, H]."""
        routing, bias = self.routing, self.e_score_correction_bias
        if x.is_cuda and routing.n_group == 1 and routing.method != "group_limited_greedy":
            from pegainfer.core.moe.kernels import route as route_kernel

            return route_kernel(x, self.gate, routing, bias)
        return route(x, self.gate, routing, bias)

    def forward(self, x: torch.Tensor, elementwise: LayerOps, capacity: int) -> torch.Tensor:
        """`capacity`: the most tokens any data-parallel rank has this step."""
        shared = self.shared_experts(x, elementwise)
        weights, chosen = self.route(x)
        experts = self.experts.weights()
        if self.data_parallel.world_size > 1:
            routed = expert_parallel.exchange(
                x, weights, chosen, experts.count, capacity, self.data_parallel, experts.apply
            )
            return routed + shared
        return self.group.all_reduce(experts.apply(x, weights, chosen, shared))
