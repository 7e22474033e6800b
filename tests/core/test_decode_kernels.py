"""Which FlashInfer decode kernel a decode batch runs (`attention.paged.DecodeKernels`) and the
engine flag that sets it (`--decode-attention-tensor-cores`); the kernels themselves run in
`test_decode_kernels_gpu.py`."""

from __future__ import annotations

import pytest

from pegainfer.core.args import DECODE_TENSOR_CORES_FROM, EngineArgs
from pegainfer.core.attention.paged import DecodeKernels, GQAShape
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.errors import ConfigError
from pegainfer.core.plugins import find_model_line

QWEN3_4B = GQAShape(32, 8, 128)  # group 4


def test_auto_splits_groups_of_four_and_eight_at_the_threshold():
    for shape in (QWEN3_4B, GQAShape(64, 8, 128)):
        kernels = DecodeKernels.for_mode("auto", shape)
        assert kernels.tensor_cores_from == DECODE_TENSOR_CORES_FROM
        assert not kernels.tensor_cores(DECODE_TENSOR_CORES_FROM - 1)
        assert kernels.tensor_cores(DECODE_TENSOR_CORES_FROM)
        assert kernels.tensor_cores(256)
    assert DecodeKernels.for_mode("auto", QWEN3_4B, threshold=64).tensor_cores_from == 64


def test_auto_keeps_small_groups_on_cuda_cores_and_odd_groups_on_tensor_cores():
    for small in (GQAShape(8, 8, 128), GQAShape(16, 8, 64), GQAShape(24, 8, 128)):
        assert not DecodeKernels.for_mode("auto", small).tensor_cores(256)
    for odd in (GQAShape(24, 4, 256), GQAShape(40, 8, 128), GQAShape(64, 4, 128)):
        assert DecodeKernels.for_mode("auto", odd).tensor_cores(1)


def test_always_and_never():
    assert all(DecodeKernels.for_mode("always", QWEN3_4B).tensor_cores(n) for n in (1, 256))
    assert not any(DecodeKernels.for_mode("never", QWEN3_4B).tensor_cores(n) for n in (1, 256))


def test_a_group_the_cuda_core_kernel_lacks_is_refused_its_kernel():
    six = GQAShape(24, 4, 256)  # 6 query heads per KV head
    with pytest.raises(ConfigError, match="not 6"):
        DecodeKernels.for_mode("never", six)
    with pytest.raises(ConfigError, match="not 6"):
        DecodeKernels(16).check(six)
    DecodeKernels(1).check(six)
    with pytest.raises(ConfigError, match="one of auto, always, never"):
        DecodeKernels.for_mode("sometimes", QWEN3_4B)
    with pytest.raises(ValueError, match="at least 1"):
        DecodeKernels(0)


def test_the_flag_is_validated():
    with pytest.raises(ConfigError, match="decode_attention_tensor_cores must be one of"):
        EngineArgs(model="m", decode_attention_tensor_cores="yes").validate()


@pytest.mark.parametrize("mode", ["never", "always"])
def test_the_engine_takes_a_choice_for_gqa_lines_and_refuses_it_for_others(mode, tmp_path):
    def args(path):
        return EngineArgs(model=str(path), device="cpu", max_model_len=128,
                          max_num_batched_tokens=64, decode_attention_tensor_cores=mode,
                          max_num_seqs=2)  # fmt: skip

    find_model_line("qwen3").write_tiny_checkpoint(tmp_path / "qwen3", seed=1)
    engine = EngineCore(args(tmp_path / "qwen3"))
    assert engine.model.attn is not None
    pytest.importorskip("pegainfer.models.deepseek")
    find_model_line("deepseek").write_tiny_checkpoint(tmp_path / "deepseek", seed=1)
    with pytest.raises(ConfigError, match="does not decode through FlashInfer's GQA"):
        EngineCore(args(tmp_path / "deepseek"))
