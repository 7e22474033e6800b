"""Random weights drawn in place (`--load-format dummy`): a model at a size no disk holds (a
full-size MoE, each rank drawing its own share) runs at its real speed, with values chosen
only to keep the forward pass finite and the routing spread, as an initialised model's are:

- a norm's weight is 1, other vectors (a router's correction bias) N(0, 0.01);
- a plain matrix N(0, 0.02) (transformers' initializer_range);
- a quantized one stores random codes (FP8 e4m3 of N(0, 1); INT4 nibbles uniform over
  [-8, 7]) with scales that give it the same spread.

Each tensor is drawn from a seed made of its name, and each routed expert of a stacked bank
(`RoutedExperts`, a range of whole experts per rank) from its tensor's name and its global
expert id: every rank draws the replicated weights alike, and an expert the same wherever it
lives, so a model divided between expert-parallel or data-parallel ranks holds the weights one
process holding every expert does (what a full-size run is checked against at fewer experts).
Tensor-parallel shards are drawn at their own shape, not cut from the whole one. Values are
drawn a slice at a time: an FP8 expert bank's float32 draw at once would take four times its
size.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from pegainfer.core.moe.layer import RoutedExperts
from pegainfer.core.ops.quant import FP8

STD = 0.02
# The spread of a uniform INT4 value over [-8, 7] (sqrt((16^2 - 1) / 12)).
_INT4_STD = 4.61
_CHUNK = 1 << 26  # elements drawn at once


def fill_random(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter of `model` (allocated, uninitialised) in place; on the meta device
    there is nothing to fill (a model built for its sizes: `pegainfer-bench memory-plan`)."""
    banks = {name: m for name, m in model.named_modules() if isinstance(m, RoutedExperts)}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.is_meta:
                continue
            bank = banks.get(name.rpartition(".")[0]) or banks.get(name.rsplit(".", 2)[0])
            if bank is None:
                _fill(name, param, _generator(param.device, seed, name))
                continue
            # Rows [i * n, (i + 1) * n) of a stacked bank (and of its scales) are expert i's.
            for local, rows in enumerate(param.chunk(bank.count)):
                expert = bank.first + local
                _fill(name, rows, _generator(param.device, seed, f"{name}:{expert}"))


def _generator(device: torch.device, seed: int, key: str) -> torch.Generator:
    """A generator seeded by `seed` and `key` (the same on every rank and in every run)."""
    digest = hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest()
    return torch.Generator(device).manual_seed(int.from_bytes(digest, "little") >> 1)


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
