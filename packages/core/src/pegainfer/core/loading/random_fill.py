"""Random weights drawn in place (`--load-format dummy`): a model at a size no disk holds (a
full-size MoE, each rank drawing its own share) runs at its real speed, with values chosen
only to keep the forward pass finite and the routing spread, as an initialised model's are:

- a norm's weight is 1, other vectors (a router's correction bias) N(0, 0.01);
- a plain matrix N(0, 0.02) (transformers' initializer_range);
- a quantized one stores random codes (FP8 e4m3 of N(0, 1); INT4 nibbles uniform over
  [-8, 7]) with scales that give it the same spread.

Each rank uses the same seed, so replicated weights agree between ranks. Values are drawn a
slice at a time: an FP8 expert bank's float32 draw at once would take four times its size.
"""

from __future__ import annotations

import torch
from torch import nn

from pegainfer.core.ops.quant import FP8

STD = 0.02
# The spread of a uniform INT4 value over [-8, 7] (sqrt((16^2 - 1) / 12)).
_INT4_STD = 4.61
_CHUNK = 1 << 26  # elements drawn at once


def fill_random(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter of `model` (allocated, uninitialised) in place; on the meta device
    there is nothing to fill (a model built for its sizes: `pegainfer-bench memory-plan`)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.is_meta:
                continue
            generator = torch.Generator(param.device).manual_seed(seed)
            _fill(name, param, generator)


def _fill(name: str, param: torch.Tensor, generator: torch.Generator) -> None:
    leaf = name.rpartition(".")[2]
    if leaf == "weight_scale_inv":  # FP8 block scales: N(0, 1) codes times 0.02
        param.fill_(STD)
    elif leaf == "weight_scale":  # INT4 group scales
        param.fill_(STD / _INT4_STD)
    elif param.dtype == torch.int32:  # packed INT4 nibbles: any bits are eight valid values
        for part in param.view(-1).split(_CHUNK):
            part.random_(generator=generator)
    elif param.dtype == FP8:
        for part in param.view(-1).split(_CHUNK):
            part.copy_(torch.randn(part.shape, generator=generator, device=part.device))
    elif param.dim() == 1:
        if leaf.endswith("norm"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.01, generator=generator)
    else:
        for part in param.view(-1).split(_CHUNK):
            part.normal_(0.0, STD, generator=generator)
