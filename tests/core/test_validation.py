"""Bad arguments and bad requests raise errors that name the problem."""

from __future__ import annotations

import msgspec
import pytest

from pegainfer.core.args import EngineArgs
from pegainfer.core.errors import ConfigError, InvalidRequestError
from pegainfer.core.sampling.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, "temperature"),
        ("temperature", float("nan"), "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -2, "top_k"),
        ("min_p", 1.1, "min_p"),
        ("max_tokens", 0, "max_tokens"),
        ("min_tokens", -1, "min_tokens"),
        ("seed", 2**64, "seed"),
        ("stop", [""], "stop"),
        ("min_tokens", 2**64, "min_tokens"),
        ("max_tokens", 2**63, "max_tokens"),
        ("stop_token_ids", [2**64], "stop_token_ids"),
        ("logit_bias", {2**64: 1.0}, "logit_bias"),
    ],
)
def test_out_of_range_sampling_values(field, value, message):
    with pytest.raises(InvalidRequestError, match=message) as err:
        SamplingParams(**{field: value}).validate()
    assert err.value.param == field


def test_validated_params_always_cross_the_message_boundary():
    """What `validate` accepts the engine's message encoding can carry (no OverflowError)."""
    big = 2**63 - 1
    params = SamplingParams(
        max_tokens=None, min_tokens=big, seed=-big - 1, stop_token_ids=[big], logit_bias={big: 1}
    ).validate()
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params


def test_min_tokens_above_max_tokens():
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4).validate()


def test_stop_token_ids_outside_the_vocabulary():
    with pytest.raises(InvalidRequestError, match=r"stop_token_ids \[99\]"):
        SamplingParams(stop_token_ids=[3, 99]).validate(vocab_size=50)


def test_valid_params_pass():
    params = SamplingParams(temperature=0.5, top_k=-1, top_p=0.9, min_p=0.1, seed=-3)
    assert params.validate(vocab_size=10) is params


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("dtype", "int8", "dtype must be one of"),
        ("device", "tpu", "device must be"),
        ("max_model_len", 0, "max_model_len must be a positive integer"),
        ("max_num_seqs", 0, "max_num_seqs"),
        ("block_size", 12, "block_size must be a power of two"),
        ("gpu_memory_utilization", 1.5, "gpu_memory_utilization"),
        ("cpu_kv_cache_gib", 0, "cpu_kv_cache_gib"),
        ("kv_cache_memory_bytes", 0, "kv_cache_memory_bytes must be a positive integer"),
    ],
)
def test_bad_engine_args(field, value, message):
    with pytest.raises(ConfigError, match=message):
        EngineArgs(model="x", **{field: value}).validate()


def test_the_kv_cache_takes_one_size():
    with pytest.raises(ConfigError, match="one size, not --num-kv-blocks and --kv-cache-memory"):
        EngineArgs(model="x", num_kv_blocks=8, kv_cache_memory_bytes=1 << 20).validate()
    with pytest.raises(ConfigError, match="not --kv-cache-memory-bytes and --cpu-kv-cache-gib"):
        EngineArgs(model="x", kv_cache_memory_bytes=1 << 20, cpu_kv_cache_gib=1.0).validate()


def test_dtype_resolution():
    import torch

    from pegainfer.core.engine.core import resolve_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}, cpu) is torch.float32
    assert resolve_dtype("bfloat16", {}, cpu) is torch.bfloat16
    assert resolve_dtype("auto", {"torch_dtype": "float32"}, cuda) is torch.bfloat16
    assert resolve_dtype("auto", {"dtype": "float16"}, cuda) is torch.float16
    assert resolve_dtype("auto", {}, cuda) is torch.bfloat16
    with pytest.raises(ConfigError, match="float32 is not supported on CUDA"):
        resolve_dtype("float32", {}, cuda)
