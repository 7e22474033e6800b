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

from dataclasses import dataclass

import torch
from torch import nn

from pegainfer.core.distributed import expert_parallel, parallel
from pegainfer.core.errors import ConfigError
from pegainfer.core.kernels.dispatch import uses_cuda_kernels
from pegainfer.core.layer_ops import LayerOps
from pegainfer.core.loading.weights import empty_param
from pegainfer.core.moe.experts import ExpertWeights, QuantizedExpertWeights
from pegainfer.core.moe.routing import Routing, route
from pegainfer.core.quant.linear import QuantLinear, linear, linear_weight
from pegainfer.core.quant.scheme import Fp8Block, WeightFormat


@dataclass(frozen=True)
class MLPFormats:
    """How a SwiGLU MLP's two matrices are stored (None: unquantized); `core.quant.scheme`
    gives them from the checkpoint's layer names (gate_proj and up_proj share one)."""

    gate_up: WeightFormat | None = None
    down: WeightFormat | None = None


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused in one matrix [2I, H]."""

    def __init__(self, hidden: int, inter: int, formats: MLPFormats | None = None) -> None:
        super().__init__()
        formats = formats or MLPFormats()
        self.gate_up_proj = linear_weight(2 * inter, hidden, formats.gate_up)
        self.down_proj = linear_weight(hidden, inter, formats.down)

    def forward(self, x: torch.Tensor, elementwise: LayerOps) -> torch.Tensor:
        h = elementwise.silu_and_mul(linear(x, self.gate_up_proj))
        return linear(h, self.down_proj)


class DenseMLP(SwiGLU):
    """A dense layer's SwiGLU MLP, its width split over the ranks."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        group: parallel.ParallelGroup,
        formats: MLPFormats | None = None,
    ) -> None:
        super().__init__(hidden, inter, formats)
        self.group = group

    def forward(self, x: torch.Tensor, elementwise: LayerOps) -> torch.Tensor:
        h = elementwise.silu_and_mul(linear(x, self.gate_up_proj))
        return parallel.row_parallel_linear(h, self.down_proj, self.group)


class RoutedExperts(nn.Module):
    """This rank's routed experts, `first`.. `first + count - 1`, stacked: `gate_up_proj`
    holds expert i's fused gate/up rows at [i * 2I, (i + 1) * 2I), `down_proj` its down rows
    at [i * H, (i + 1) * H) (2-D, so the loader fills each expert's rows like any fused
    matrix's; `weights()` gives the [experts, ...] views the compute reads). `width`: the
    [start, end) of each expert's intermediate features held here (None: all of them).
    Quantized experts (`formats`) are two `QuantLinear` stacks filled the same way."""

    def __init__(
        self, hidden: int, inter: int, count: int, first: int,
        width: tuple[int, int] | None = None, formats: MLPFormats | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.hidden, self.inter, self.count, self.first = hidden, inter, count, first
        self.width = width
        formats = formats or MLPFormats()
        if (formats.gate_up is None) != (formats.down is None):
            raise ConfigError("routed experts must be quantized in all their matrices or none")
        for fmt, rows in ((formats.gate_up, inter), (formats.down, hidden)):
            # Each expert's gate, up and down rows start on a block of scale rows.
            if isinstance(fmt, Fp8Block) and rows % fmt.block[0]:
                raise ConfigError(
                    f"FP8 experts need their widths ({inter} and {hidden}, per rank) to be "
                    f"multiples of the block's {fmt.block[0]} rows"
                )
        self.gate_up_proj = linear_weight(count * 2 * inter, hidden, formats.gate_up)
        self.down_proj = linear_weight(count * hidden, inter, formats.down)

    def weights(self) -> ExpertWeights:
        gate_up, down = self.gate_up_proj, self.down_proj
        if isinstance(gate_up, QuantLinear) and isinstance(down, QuantLinear):
            assert gate_up.fmt == down.fmt, "one kernel runs both matrices"
            (w13, s13), (w2, s2) = gate_up.stored(), down.stored()
            return QuantizedExpertWeights(
                w13.view(self.count, 2 * self.inter, -1), w2.view(self.count, self.hidden, -1),
                self.first, gate_up_scale=s13.view(self.count, -1, s13.shape[-1]),
                down_scale=s2.view(self.count, -1, s2.shape[-1]), fmt=gate_up.fmt,
            )  # fmt: skip
        return ExpertWeights(
            gate_up.view(self.count, 2 * self.inter, self.hidden),
            down.view(self.count, self.hidden, self.inter),
            self.first,
        )


class MoE(nn.Module):
    """Routed experts beside always-on shared ones (`num_shared` of width `inter`, fused in
    one MLP), routed by `routing` (module docstring: how the ranks divide them); `routed` and
    `shared` say how each is stored (None: unquantized)."""

    def __init__(
        self, hidden: int, inter: int, num_shared: int, routing: Routing,
        group: parallel.ParallelGroup, expert_parallel: bool,
        data_parallel: parallel.ParallelGroup, routed: MLPFormats | None = None,
        shared: MLPFormats | None = None,
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
            first = data_parallel.rank * local
            self.experts = RoutedExperts(hidden, inter, local, first, formats=routed)
        elif expert_parallel:
            local = num_experts // group.world_size
            self.experts = RoutedExperts(hidden, inter, local, group.rank * local, formats=routed)
        else:
            width = group.split(inter)
            self.experts = RoutedExperts(hidden, width[1] - width[0], num_experts, 0, width,
                                         routed)  # fmt: skip
        self.shared_experts = SwiGLU(hidden, inter * num_shared // group.world_size, shared)

    def warmup_token_counts(self, max_tokens: int) -> frozenset[int]:
        """Step sizes whose fused-MoE launches make every specialization a step can need
        (`runner.warmup`)."""
        from pegainfer.core.moe.kernels import specializing_token_counts

        return specializing_token_counts(max_tokens, self.routing.top_k, self.experts.count)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, experts [T, k]) of the tokens x [T, H]."""
        routing, bias = self.routing, self.e_score_correction_bias
        if uses_cuda_kernels(x):
            from pegainfer.core.moe import kernels

            if kernels.routes_in_a_kernel(routing):
                return kernels.route(x, self.gate, routing, bias)
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
