"""`core.dense`: the dense layers' multiplies, cuBLAS by default and the small-batch GEMV with
`--small-batch-gemv` (CUDA: `test_dense_ops_gpu.py`; the gate with it on:
`tests/qwen3/test_engine_gpu.py`)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.args import EngineArgs
from pegainfer.core.dense import dense_ops
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.errors import ConfigError
from pegainfer.core.ops.activation import silu_and_mul
from pegainfer.core.plugins import find_model_line

CPU = torch.device("cpu")


def test_the_default_is_linear_and_the_activation_after_it():
    ops = dense_ops(CPU)
    x, w, gate_up = torch.randn(3, 8), torch.randn(5, 8), torch.randn(10, 8)
    assert torch.equal(ops.head(x, w), torch.nn.functional.linear(x, w))
    assert torch.equal(ops.gated(x, gate_up), silu_and_mul(torch.nn.functional.linear(x, gate_up)))


def test_the_gemv_is_refused_off_cuda(tmp_path):
    with pytest.raises(ValueError, match="CUDA kernel"):
        dense_ops(CPU, small_batch_gemv=True)
    find_model_line("qwen3").write_tiny_checkpoint(tmp_path, seed=1)
    args = EngineArgs(model=str(tmp_path), device="cpu", max_model_len=128, max_num_seqs=2,
                      max_num_batched_tokens=64, small_batch_gemv=True)  # fmt: skip
    with pytest.raises(ConfigError, match="--small-batch-gemv runs a CUDA kernel"):
        EngineCore(args)
