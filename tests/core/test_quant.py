"""Quantized weights on the CPU: `quantization_config` parsing, the torch reference
(dequantization with partial blocks, INT4 nibble order), the loader (fused parts, tensor-parallel
shares, refusals) and `QuantLinear`'s reference forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from pegainfer.core.errors import ConfigError, WeightLoadError
from pegainfer.core.loading.weights import WeightTarget, load_weights
from pegainfer.core.ops import quant as ref
from pegainfer.core.quant.linear import QuantLinear, linear, linear_weight
from pegainfer.core.quant.scheme import Fp8Block, Int4Group, parse_quantization

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}  # fmt: skip
# Kimi-K2-Thinking's: INT4 routed experts, everything else unquantized.
KIMI_INT4_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "quantization_status": "compressed", "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": 32, "dynamic": False, "actorder": None,
                    "block_structure": None, "observer": "minmax", "observer_kwargs": {}},
    }},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}  # fmt: skip


def scheme_of(qc: dict):
    return parse_quantization({"quantization_config": qc})


# --- quantization_config -----------------------------------------------------------------


def test_fp8_block_scheme_quantizes_linears_but_the_lm_head():
    scheme = scheme_of(FP8_CONFIG)
    assert scheme.format_for("model.layers.0.self_attn.q_proj") == Fp8Block((128, 128))
    assert scheme.format_for("lm_head") is None
    assert parse_quantization({"model_type": "qwen3"}) is None


@pytest.mark.parametrize("field", ["modules_to_not_convert", "ignored_layers"])
def test_fp8_ignore_lists_match_as_transformers_does(field):
    from transformers.quantizers.quantizers_utils import should_convert_module

    patterns = ["model.layers.1", "mlp.gate", "model.layers.*.o_proj", "layers.*.v_proj"]
    scheme = scheme_of(FP8_CONFIG | {field: patterns})
    assert scheme.format_for("model.layers.1.self_attn.q_proj") is None  # prefix, boundary
    assert scheme.format_for("model.layers.11.self_attn.q_proj") is not None
    assert scheme.format_for("model.layers.0.mlp.gate") is None  # suffix
    assert scheme.format_for("model.layers.0.mlp.gate_proj") is not None
    assert scheme.format_for("model.layers.3.self_attn.o_proj") is None  # regex
    names = [f"model.layers.{i}.{m}" for i in (0, 1, 3, 10, 11)
             for m in ("self_attn.q_proj", "self_attn.o_proj", "self_attn.v_proj", "mlp.gate",
                       "mlp.gate_proj", "mlp.experts.0.down_proj")] + ["lm_head"]  # fmt: skip
    for name in names:
        assert (scheme.format_for(name) is not None) == should_convert_module(name, patterns)
    # An explicit list replaces transformers' default skip of the LM head.
    assert scheme.format_for("lm_head") is not None


def test_compressed_tensors_int4_targets_and_ignore():
    scheme = scheme_of(KIMI_INT4_CONFIG)
    assert scheme.format_for("model.layers.1.mlp.experts.7.gate_proj") == Int4Group(32)
    for ignored in (
        "lm_head",
        "model.layers.1.self_attn.q_a_proj",
        "model.layers.1.mlp.shared_experts.down_proj",
        "model.layers.0.mlp.up_proj",
    ):
        assert scheme.format_for(ignored) is None, ignored  # fmt: skip


def test_compressed_tensors_fp8_block_group():
    weights = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128],
               "symmetric": True, "dynamic": False}  # fmt: skip
    acts = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128,
            "dynamic": True, "symmetric": True}  # fmt: skip
    group = {"targets": ["re:.*self_attn.*"], "weights": weights, "input_activations": acts}
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"g": group}}  # fmt: skip
    scheme = scheme_of(qc)
    fmt = scheme.format_for("model.layers.0.self_attn.o_proj")
    assert fmt == Fp8Block((128, 128), scale_suffix="weight_scale")
    assert scheme.format_for("model.layers.0.mlp.down_proj") is None


@pytest.mark.parametrize(
    ("qc", "field"),
    [
        ({"quant_method": "awq"}, "quant_method"),
        (FP8_CONFIG | {"weight_block_size": None}, "weight_block_size"),
        (FP8_CONFIG | {"activation_scheme": "static"}, "activation_scheme"),
        (FP8_CONFIG | {"fmt": "e5m2"}, "fmt"),
        (FP8_CONFIG | {"weight_block_size": [128]}, "weight_block_size"),
        (FP8_CONFIG | {"surprise": 1}, "surprise"),
        (KIMI_INT4_CONFIG | {"format": "marlin-24"}, "format"),
        (KIMI_INT4_CONFIG | {"kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    ],
)
def test_unsupported_schemes_are_refused_by_field(qc, field):
    with pytest.raises(ConfigError, match=field):
        scheme_of(qc)


@pytest.mark.parametrize(
    ("key", "value"),
    [("num_bits", 8), ("symmetric", False), ("strategy", "channel"), ("group_size", 20),
     ("actorder", "group"), ("dynamic", True)],
)  # fmt: skip
def test_unsupported_int4_weight_settings_are_refused(key, value):
    qc = json.loads(json.dumps(KIMI_INT4_CONFIG))
    qc["config_groups"]["group_0"]["weights"][key] = value
    with pytest.raises(ConfigError, match=key):
        scheme_of(qc)


def test_layers_fused_into_one_matrix_must_share_a_format():
    scheme = scheme_of(FP8_CONFIG | {"modules_to_not_convert": ["k_proj"]})
    with pytest.raises(ConfigError, match="differently"):
        scheme.common_format(["m.q_proj", "m.k_proj", "m.v_proj"])
    assert scheme.common_format(["m.q_proj", "m.v_proj"]) == Fp8Block((128, 128))


# --- torch reference -----------------------------------------------------------------------


@pytest.mark.parametrize(("rows", "cols"), [(576, 256), (192, 300), (128, 128), (7, 5)])
def test_fp8_dequantization_uses_ceil_blocks(rows, cols):
    torch.manual_seed(0)
    weight = (torch.randn(rows, cols) * 20).to(ref.FP8)
    scale = torch.rand(-(-rows // 128), -(-cols // 128)) + 0.5
    out = ref.dequantize_fp8_block(weight, scale, (128, 128), torch.float32)
    for r in range(0, rows, 61):
        for c in range(0, cols, 37):
            expected = weight[r, c].float() * scale[r // 128, c // 128]
            assert out[r, c] == expected


def test_fp8_quantize_round_trip():
    torch.manual_seed(0)
    w = torch.randn(576, 300)
    q, scale = ref.quantize_fp8_block(w, (128, 128))
    assert q.dtype == ref.FP8 and scale.shape == (5, 3)
    back = ref.dequantize_fp8_block(q, scale, (128, 128), torch.float32)
    assert (back - w).norm() / w.norm() < 0.04
    # Each block's largest magnitude maps to 448 exactly.
    assert q[:128, :128].float().abs().max() == ref.FP8_MAX


def test_int4_nibbles_are_low_first_and_offset_by_8():
    # Word 0 holds columns 0..7: value v at nibble j is stored as v + 8 in bits 4j..4j+3.
    values = torch.tensor([[-8, -1, 0, 1, 2, 3, 6, 7]])
    word = sum((v + 8) << (4 * j) for j, v in enumerate(values[0].tolist()))
    packed = ref.pack_int4(values)
    assert packed.dtype == torch.int32
    assert packed.item() == word - (1 << 32 if word >= 1 << 31 else 0)
    assert torch.equal(ref.unpack_int4(packed).long(), values)


def test_int4_matches_compressed_tensors_packing():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    torch.manual_seed(0)
    values = torch.randint(-8, 8, (16, 64), dtype=torch.int8)
    theirs = helpers.pack_to_int32(values, 4)
    assert torch.equal(ref.pack_int4(values), theirs)
    assert torch.equal(ref.unpack_int4(theirs), values)


def test_int4_quantize_round_trip():
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    packed, scale = ref.quantize_int4_group(w, 32)
    assert packed.shape == (64, 32) and scale.shape == (64, 8) and scale.dtype == torch.bfloat16
    back = ref.dequantize_int4_group(packed, scale, 32, torch.float32)
    assert (back - w).norm() / w.norm() < 0.12
    assert torch.equal(back[3, 40], ref.unpack_int4(packed)[3, 40].float() * scale[3, 1].float())


def test_activation_quantization_per_token_group():
    torch.manual_seed(0)
    x = torch.randn(5, 300)
    q, scale = ref.quantize_activations_fp8(x, 128)
    assert q.shape == (5, 300) and scale.shape == (5, 3)
    assert torch.allclose(scale[:, 0], x[:, :128].abs().amax(dim=1) / ref.FP8_MAX)
    back = q.float() * scale.repeat_interleave(128, dim=1)[:, :300]
    assert (back - x).norm() / x.norm() < 0.04


# --- QuantLinear ---------------------------------------------------------------------------


def quant_linear(fmt, weight: torch.Tensor) -> QuantLinear:
    layer = QuantLinear(*weight.shape, fmt)
    if isinstance(fmt, Fp8Block):
        q, scale = ref.quantize_fp8_block(weight, fmt.block)
    else:
        q, scale = ref.quantize_int4_group(weight, fmt.group_size)
    for part, value in zip(fmt.parts, (q, scale), strict=True):
        setattr(layer, part.suffix, torch.nn.Parameter(value, requires_grad=False))
    return layer


@pytest.mark.parametrize("fmt", [Fp8Block((128, 128)), Fp8Block((32, 48)), Int4Group(32)])
def test_quant_linear_cpu_is_the_dequantized_matmul(fmt):
    torch.manual_seed(0)
    layer = quant_linear(fmt, torch.randn(200, 96))
    x = torch.randn(3, 96)
    assert torch.equal(linear(x, layer), F.linear(x, layer.dequantize(torch.float32)))
    assert linear_weight(4, 8, None).shape == (4, 8)


def test_int4_linear_needs_whole_groups():
    with pytest.raises(ConfigError, match="multiple of the group size"):
        QuantLinear(8, 48, Int4Group(32))


# --- the loader ----------------------------------------------------------------------------


class Fused(torch.nn.Module):
    """q (rows 0..q) and kv (rows q..q+kv) of one matrix, as DeepSeek fuses q_a and kv_a."""

    def __init__(self, fmt, q_rows: int, kv_rows: int, cols: int) -> None:
        super().__init__()
        self.q_rows, self.kv_rows = q_rows, kv_rows
        with torch.device("meta"):
            self.proj = linear_weight(q_rows + kv_rows, cols, fmt)

    def name_map(self, name: str) -> WeightTarget:
        if name == "a.q.weight":
            return WeightTarget("proj", 0, self.q_rows)
        if name == "a.kv.weight":
            return WeightTarget("proj", self.q_rows, self.kv_rows)
        return WeightTarget(name)


def write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    return path


def allocated(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    from pegainfer.core.loading.weights import allocate_parameters

    allocate_parameters(module, torch.device("cpu"))
    return dict(module.named_parameters())


def test_fused_fp8_parts_with_a_partial_last_block(tmp_path):
    """Kimi's q_a (1536 rows) + kv_a (576 rows: 5 scale rows, the last partial)."""
    torch.manual_seed(0)
    q_w, kv_w = torch.randn(1536, 256), torch.randn(576, 256)
    tensors = {}
    for name, w in (("a.q", q_w), ("a.kv", kv_w)):
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = ref.quantize_fp8_block(
            w, (128, 128)
        )
    model = Fused(Fp8Block(), 1536, 576, 256)
    params = allocated(model)
    load_weights(params, write(tmp_path, tensors), model.name_map, progress=False,
                 scheme=scheme_of(FP8_CONFIG))  # fmt: skip
    assert model.proj.weight_scale_inv.shape == (17, 2)
    expected = torch.cat([
        ref.dequantize_fp8_block(tensors[f"{n}.weight"], tensors[f"{n}.weight_scale_inv"],
                                 (128, 128), torch.float32)
        for n in ("a.q", "a.kv")
    ])  # fmt: skip
    assert torch.equal(model.proj.dequantize(torch.float32), expected)


def test_a_fused_part_must_start_on_a_block(tmp_path):
    tensors = {}
    for name, rows in (("a.q", 96), ("a.kv", 64)):
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = ref.quantize_fp8_block(
            torch.randn(rows, 128), (128, 128)
        )
    model = Fused(Fp8Block(), 96, 64, 128)
    with pytest.raises(WeightLoadError, match="cut its quantization blocks of 128"):
        load_weights(allocated(model), write(tmp_path, tensors), model.name_map, progress=False,
                     scheme=scheme_of(FP8_CONFIG))  # fmt: skip


class Sharded(torch.nn.Module):
    """Rank `rank` of `world`'s rows (column-parallel) or columns (row-parallel) of a.w."""

    def __init__(self, fmt, rows: int, cols: int, rank: int, world: int, split_rows: bool):
        super().__init__()
        self.split_rows = split_rows
        self.rows = (rank * rows // world, (rank + 1) * rows // world)
        self.cols = (rank * cols // world, (rank + 1) * cols // world)
        shape = (rows // world, cols) if split_rows else (rows, cols // world)
        with torch.device("meta"):
            self.w = linear_weight(*shape, fmt)

    def name_map(self, name: str) -> WeightTarget:
        assert name == "a.w.weight", name
        if self.split_rows:
            return WeightTarget("w", rows=self.rows)
        return WeightTarget("w", cols=self.cols)


@pytest.mark.parametrize("split_rows", [True, False], ids=["rows", "columns"])
@pytest.mark.parametrize("fmt", [Fp8Block((128, 128)), Int4Group(32)], ids=["fp8", "int4"])
def test_tensor_parallel_shares_dequantize_to_the_full_weights_slices(tmp_path, fmt, split_rows):
    torch.manual_seed(0)
    full = torch.randn(512, 512)
    layer = quant_linear(fmt, full)
    tensors = {f"a.w.{part.suffix}": getattr(layer, part.suffix) for part in fmt.parts}
    if isinstance(fmt, Int4Group):
        tensors["a.w.weight_shape"] = torch.tensor([512, 512])
    path = write(tmp_path, tensors)
    qc = FP8_CONFIG if isinstance(fmt, Fp8Block) else KIMI_INT4_CONFIG
    whole = layer.dequantize(torch.float32)
    for rank in range(4):
        shard = Sharded(fmt, 512, 512, rank, 4, split_rows)
        load_weights(allocated(shard), path, shard.name_map, progress=False, scheme=scheme_of(qc))
        mine = slice(rank * 128, (rank + 1) * 128)
        piece = whole[mine] if split_rows else whole[:, mine]
        assert torch.equal(shard.w.dequantize(torch.float32), piece)


def test_a_share_that_cuts_a_block_is_refused(tmp_path):
    """384 FP8 rows over 2 ranks is 192 each: 1.5 blocks. (An INT4 share that cuts a group
    has a partial group of its own: `QuantLinear` refuses it, above.)"""
    layer = quant_linear(Fp8Block(), torch.randn(384, 384))
    tensors = {f"a.w.{part.suffix}": getattr(layer, part.suffix) for part in Fp8Block().parts}
    shard = Sharded(Fp8Block(), 384, 384, 0, 2, split_rows=True)
    with pytest.raises(WeightLoadError, match="cut its quantization blocks"):
        load_weights(allocated(shard), write(tmp_path, tensors), shard.name_map, progress=False,
                     scheme=scheme_of(FP8_CONFIG))  # fmt: skip


def test_int4_weight_shape_is_checked(tmp_path):
    layer = quant_linear(Int4Group(32), torch.randn(8, 64))
    tensors = {"a.w.weight_packed": layer.weight_packed, "a.w.weight_scale": layer.weight_scale,
               "a.w.weight_shape": torch.tensor([8, 60])}  # fmt: skip
    shard = Sharded(Int4Group(32), 8, 64, 0, 1, split_rows=True)
    with pytest.raises(WeightLoadError, match="weight_shape is"):
        load_weights(allocated(shard), write(tmp_path, tensors), shard.name_map, progress=False,
                     scheme=scheme_of(KIMI_INT4_CONFIG))  # fmt: skip


def test_another_ranks_int4_expert_is_skipped_whole(tmp_path):
    layer = quant_linear(Int4Group(32), torch.randn(8, 64))
    tensors = {"a.w.weight_packed": layer.weight_packed, "a.w.weight_scale": layer.weight_scale,
               "a.w.weight_shape": torch.tensor([8, 64])}  # fmt: skip
    load_weights({}, write(tmp_path, tensors), lambda name: None, progress=False,
                 scheme=scheme_of(KIMI_INT4_CONFIG))  # fmt: skip


def test_quantized_tensors_never_load_as_plain_weights(tmp_path):
    """An FP8 weight into a plain parameter (the line did not build it quantized), or a plain
    weight where the scheme says FP8: refused, never cast."""
    q, scale = ref.quantize_fp8_block(torch.randn(8, 8), (128, 128))
    plain = Sharded(None, 8, 8, 0, 1, split_rows=True)
    with pytest.raises(WeightLoadError, match="is quantized .* built 'w' unquantized"):
        load_weights(allocated(plain), write(tmp_path / "a", {"a.w.weight": q}), plain.name_map,
                     progress=False)  # fmt: skip
    fp8 = Sharded(Fp8Block(), 8, 8, 0, 1, split_rows=True)
    tensors = {"a.w.weight": torch.randn(8, 8), "a.w.weight_scale_inv": scale}
    with pytest.raises(WeightLoadError, match="float32, but quantization_config stores it as"):
        load_weights(allocated(fp8), write(tmp_path / "b", tensors), fp8.name_map,
                     progress=False, scheme=scheme_of(FP8_CONFIG))  # fmt: skip
    with pytest.raises(WeightLoadError, match="built 'w' unquantized"):
        load_weights(allocated(plain), write(tmp_path / "c", {"a.w.weight": q,
                                                              "a.w.weight_scale_inv": scale}),
                     plain.name_map, progress=False, scheme=scheme_of(FP8_CONFIG))  # fmt: skip


def test_bf16_scales_widen_exactly(tmp_path):
    q, scale = ref.quantize_fp8_block(torch.randn(8, 8), (128, 128))
    layer = Sharded(Fp8Block(), 8, 8, 0, 1, split_rows=True)
    tensors = {"a.w.weight": q, "a.w.weight_scale_inv": scale.bfloat16()}
    load_weights(allocated(layer), write(tmp_path, tensors), layer.name_map, progress=False,
                 scheme=scheme_of(FP8_CONFIG))  # fmt: skip
    assert layer.w.weight_scale_inv.dtype == torch.float32
    assert torch.equal(layer.w.weight_scale_inv, scale.bfloat16().float())


@pytest.mark.parametrize("fmt", [Fp8Block((128, 128)), Int4Group(32)], ids=["fp8", "int4"])
def test_random_quantized_weights_have_the_asked_spread(fmt):
    from pegainfer.core.quant.linear import dequantize
    from pegainfer.core.quant.random import random_quantized

    g = torch.Generator().manual_seed(0)
    weight, scale = random_quantized(fmt, (3, 256, 384), 0.05, g, "cpu")
    for part, tensor in zip(fmt.parts, (weight, scale), strict=True):
        assert tensor.dtype == part.dtype and tensor.shape == (3, *part.shape(256, 384))
    values = dequantize(weight, scale, fmt, torch.float32)
    assert values.shape == (3, 256, 384) and values.isfinite().all()
    assert 0.04 < values.std().item() < 0.06
    assert not torch.equal(values[0], values[1])  # each matrix drawn afresh
