"""Quantized routed experts on the CPU: a bank of FP8-block or INT4 experts loaded from the
per-expert checkpoint layout, and its reference (each chosen expert dequantized exactly)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.errors import ConfigError
from pegainfer.core.loading.weights import WeightTarget, allocate_parameters, load_weights
from pegainfer.core.moe.experts import QuantizedExpertWeights, moe
from pegainfer.core.moe.layer import MLPFormats, RoutedExperts
from pegainfer.core.moe.routing import Routing, route
from pegainfer.core.ops import quant as ref
from pegainfer.core.quant.linear import dequantize
from pegainfer.core.quant.scheme import Fp8Block, Int4Group, parse_quantization
from tests.quant_checkpoints import FP8_BLOCK_CONFIG, int4_config, quantize_checkpoint

HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 6, 2
FORMATS = {
    "fp8": (Fp8Block((32, 32)), FP8_BLOCK_CONFIG | {"weight_block_size": [32, 32]}),
    "int4": (Int4Group(32), int4_config(ignore=["lm_head"])),
}


class Bank(torch.nn.Module):
    """One MoE layer's routed experts `first`.. as a line holds them, with the per-expert
    name map of `core.latent_moe` (checkpoint `mlp.experts.E.{gate,up,down}_proj`)."""

    def __init__(self, fmt, count: int = EXPERTS, first: int = 0) -> None:
        super().__init__()
        with torch.device("meta"):
            self.experts = RoutedExperts(HIDDEN, INTER, count, first,
                                         formats=MLPFormats(fmt, fmt))  # fmt: skip
        allocate_parameters(self, torch.device("cpu"))

    def name_map(self, name: str) -> WeightTarget | None:
        _, _, expert, leaf, _ = name.rsplit(".", 4)
        local = int(expert) - self.experts.first
        if not 0 <= local < self.experts.count:
            return None
        if leaf == "down_proj":
            return WeightTarget("experts.down_proj", local * HIDDEN, HIDDEN)
        offset = local * 2 * INTER + (0 if leaf == "gate_proj" else INTER)
        return WeightTarget("experts.gate_up_proj", offset, INTER)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same random experts unquantized, then stored as each format."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("experts")
    torch.manual_seed(0)
    tensors = {}
    for e in range(EXPERTS):
        for leaf, shape in (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)),
                            ("down_proj", (HIDDEN, INTER))):  # fmt: skip
            tensors[f"model.layers.1.mlp.experts.{e}.{leaf}.weight"] = torch.randn(shape) * 0.1
    (root / "plain").mkdir()
    save_file(tensors, root / "plain" / "model.safetensors")
    (root / "plain" / "config.json").write_text("{}")
    for name, (_, qc) in FORMATS.items():
        quantize_checkpoint(root / "plain", root / name, qc, lambda module: True)
    return root


def loaded(checkpoints, name: str, first: int = 0, count: int = EXPERTS) -> Bank:
    fmt, qc = FORMATS[name]
    bank = Bank(fmt, count, first)
    scheme = parse_quantization({"quantization_config": qc})
    load_weights(dict(bank.named_parameters()), checkpoints / name, bank.name_map,
                 progress=False, scheme=scheme)  # fmt: skip
    return bank


def routed(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    gate = torch.randn(EXPERTS, HIDDEN, generator=g)
    weights, experts = route(x, gate, Routing(EXPERTS, TOP_K))
    return x, weights, experts


def dequantized_experts(checkpoints, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's gate_up [2I, H] and down [H, I], dequantized straight from the files."""
    from safetensors.torch import load_file

    fmt, _ = FORMATS[name]
    stored = load_file(checkpoints / name / "model.safetensors")
    scale = fmt.parts[1].suffix

    def weight(e: int, leaf: str) -> torch.Tensor:
        prefix = f"model.layers.1.mlp.experts.{e}.{leaf}"
        return dequantize(stored[f"{prefix}.{fmt.parts[0].suffix}"], stored[f"{prefix}.{scale}"],
                          fmt, torch.float32)  # fmt: skip

    gate_up = torch.stack([torch.cat([weight(e, "gate_proj"), weight(e, "up_proj")])
                           for e in range(EXPERTS)])  # fmt: skip
    down = torch.stack([weight(e, "down_proj") for e in range(EXPERTS)])
    return gate_up, down


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantized_bank_is_the_dequantized_moe(checkpoints, name):
    bank = loaded(checkpoints, name).experts.weights()
    assert isinstance(bank, QuantizedExpertWeights) and bank.count == EXPERTS
    x, weights, experts = routed(9, seed=1)
    gate_up, down = dequantized_experts(checkpoints, name)
    assert torch.equal(bank.apply(x, weights, experts), moe(x, weights, experts, gate_up, down))
    shared = torch.randn_like(x)
    expected = moe(x, weights, experts, gate_up, down) + shared
    assert torch.equal(bank.apply(x, weights, experts, shared), expected)


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_range_of_quantized_experts(checkpoints, name):
    """Expert parallelism: experts 3..5 here; the others' files are skipped, their pairs add
    nothing."""
    bank = loaded(checkpoints, name, first=3, count=3).experts.weights()
    x, weights, experts = routed(20, seed=2)
    gate_up, down = dequantized_experts(checkpoints, name)
    mine = slice(3, 6)
    expected = moe(x, weights, experts, gate_up[mine], down[mine], first=3)
    assert torch.equal(bank.apply(x, weights, experts), expected)


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantization_matters(checkpoints, name):
    """Guard: the quantized banks hold quantized weights, not the original ones."""
    x, weights, experts = routed(9, seed=3)
    plain = Bank(None)
    load_weights(dict(plain.named_parameters()), checkpoints / "plain", plain.name_map,
                 progress=False)  # fmt: skip
    quantized = loaded(checkpoints, name).experts
    assert quantized.gate_up_proj.stored()[0].dtype in (ref.FP8, torch.int32)
    diff = quantized.weights().apply(x, weights, experts) - plain.experts.weights().apply(
        x, weights, experts
    )
    assert diff.abs().max() > 1e-4


def test_fp8_experts_must_be_whole_blocks():
    with pytest.raises(ConfigError, match="multiples of the block's 128 rows"):
        RoutedExperts(HIDDEN, INTER, 4, 0, formats=MLPFormats(Fp8Block(), Fp8Block()))
    with pytest.raises(ConfigError, match="all their matrices or none"):
        RoutedExperts(HIDDEN, INTER, 4, 0, formats=MLPFormats(Int4Group(32), None))
