"""The weights a step's matmuls multiply by, counted as the matmuls see them: what a step's
FLOPs follow (the benchmarks' physical limits, the piecewise graphs' launch-bound cap)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from pegainfer.core.moe.layer import MoE
from pegainfer.core.quant.linear import QuantLinear
from pegainfer.core.quant.scheme import Fp8Block

# Parameters (and their modules) outside every matmul of a step's rows: the embedding is
# gathered, and the LM head runs for one row of a prompt.
_NOT_MATMULS = ("embed_tokens", "lm_head")


def is_routed(name: str) -> bool:
    """Whether the parameter or module `name` belongs to a MoE layer's routed experts."""
    return ".mlp.experts." in name


@dataclass(frozen=True)
class MatmulWeights:
    """Elements of a model's weights as the matmuls see them (a packed INT4 int32 holds eight,
    quantization scales hold none), the embedding table and the LM head left out."""

    elements: int
    routed: int  # of which the routed experts'
    fp8: int  # of which stored FP8 outside the routed experts (FP8 x FP8 GEMMs in prefill)

    @classmethod
    def of(cls, model: nn.Module) -> MatmulWeights:
        quantized = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
        sizes = [(name, p.numel(), False) for name, p in model.named_parameters()
                 if name.rpartition(".")[0] not in quantized]  # fmt: skip
        sizes += [(name, m.out_features * m.in_features, isinstance(m.fmt, Fp8Block))
                  for name, m in quantized.items()]  # fmt: skip
        sizes = [size for size in sizes if not size[0].startswith(_NOT_MATMULS)]
        return cls(
            elements=sum(n for _, n, _ in sizes),
            routed=sum(n for name, n, _ in sizes if is_routed(name)),
            fp8=sum(n for name, n, fp8 in sizes if fp8 and not is_routed(name)),
        )


def matmul_flops_per_token(model: nn.Module) -> float:
    """FLOPs of one token's pass through the model's matmuls (2 per weight element), the
    routed experts counted for the `top_k` of them a token chooses, the LM head left out."""
    weights = MatmulWeights.of(model)
    routing = next((m.routing for m in model.modules() if isinstance(m, MoE)), None)
    chosen = routing.top_k / routing.num_experts if routing is not None else 0.0
    return 2.0 * (weights.elements - weights.routed + weights.routed * chosen)
