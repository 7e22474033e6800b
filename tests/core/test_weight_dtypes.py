"""A parameter made with a dtype of its own keeps it when the model is built in another."""

from __future__ import annotations

import torch
from safetensors.torch import save_file
from torch import nn

from pegainfer.core.loading.weights import WeightTarget, build_and_load, empty_param
from pegainfer.core.model import ModelContext


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = empty_param(4, 8)
        self.bias = empty_param(4, dtype=torch.float32)

    def checkpoint_name_map(self, name: str) -> WeightTarget:
        return WeightTarget(name)


def test_a_float32_parameter_stays_float32_in_a_bf16_model(tmp_path):
    bias = torch.tensor([1e-4, 1.0 + 1e-6, -3.0, 0.5])  # not representable in bf16
    save_file({"gate": torch.randn(4, 8), "bias": bias}, tmp_path / "model.safetensors")
    ctx = ModelContext(tmp_path, {}, torch.bfloat16, torch.device("cpu"))
    model = build_and_load(Router, ctx)
    assert model.gate.dtype == torch.bfloat16
    assert model.bias.dtype == torch.float32 and torch.equal(model.bias, bias)
