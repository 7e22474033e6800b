"""Bad arguments and bad requests raise errors that name the problem."""

from __future__ import annotations

import dataclasses

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


@pytest.mark.parametrize(
    ("config", "method", "tokens"),
    [
        ('{"method": "mtp", "num_speculative_tokens": 3}', "mtp", 3),
        ('{"method": "deepseek_mtp", "num_speculative_tokens": 2}', "mtp", 2),
        ('{"method": "glm4_moe_mtp"}', "mtp", 1),  # vLLM's default: the draft's n_predict, 1
        ('{"method": "self", "num_speculative_tokens": 4}', "self", 4),
    ],
)
def test_vllm_speculative_config_sets_the_flags(config, method, tokens):
    """`--speculative-config` as vLLM takes it, through the server's parser."""
    from pegainfer.server.cli import build_parser

    options = vars(build_parser().parse_args(["--model-path", "x", "--speculative-config",
                                              config]))  # fmt: skip
    engine = {f.name for f in dataclasses.fields(EngineArgs)}
    args = EngineArgs(**{k: v for k, v in options.items() if k in engine}).validate()
    assert (args.speculative_method, args.speculative_tokens) == (method, tokens)
    assert args.validate() is args  # validating again finds the same flags
    explicit = EngineArgs(model="x", speculative_config=config, speculative_tokens=tokens,
                          speculative_method=method).validate()  # fmt: skip
    assert (explicit.speculative_method, explicit.speculative_tokens) == (method, tokens)


@pytest.mark.parametrize(
    ("config", "flags", "message"),
    [
        ('{"method": "eagle3", "model": "m"}', {}, "'model' not supported"),
        ('{"method": "ngram"}', {}, "method 'ngram' is not supported"),
        ('{"method": "mtp", "num_speculative_tokens": 0}', {}, "positive integer, got 0"),
        ('{"num_speculative_tokens": "3"}', {}, "positive integer, got '3'"),
        ("mtp", {}, "not JSON"),
        ("[3]", {}, "must be a JSON object"),
        ('{"num_speculative_tokens": 3}', {"speculative_tokens": 2}, "--speculative-tokens 2"),
        ('{"method": "mtp"}', {"speculative_method": "self"}, "--speculative-method self"),
        ('{"num_speculative_tokens": 9}', {}, "speculative_tokens must be in"),
    ],
)
def test_bad_speculative_config(config, flags, message):
    with pytest.raises(ConfigError, match=message):
        EngineArgs(model="x", speculative_config=config, **flags).validate()
