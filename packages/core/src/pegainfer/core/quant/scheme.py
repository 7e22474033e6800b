"""A checkpoint's `quantization_config`, parsed into which linear layers are stored how.

Two families of checkpoints are understood, and nothing else is loaded:

- `quant_method: fp8` with `weight_block_size` (DeepSeek-V3, Kimi-K2-Instruct, GLM-5-FP8,
  Qwen3-*-FP8): every linear layer's `weight` in float8 e4m3 with a float32 `weight_scale_inv`
  per block of the weight (the multiplier that dequantizes it), activations quantized
  dynamically. Layers listed in `modules_to_not_convert` (transformers' name) or
  `ignored_layers` (vLLM's) stay unquantized, matched as transformers matches them: a prefix
  ending at a module boundary, a regular expression, or a suffix. Without a list,
  transformers skips the LM head; so do we.
- `quant_method: compressed-tensors` (Kimi-K2-Thinking, K2.5/K2.6): config groups whose
  `targets` pick layers (the class name `Linear`, an exact name, or `re:` + a regular expression
  matched at the start of the name), minus the `ignore` list (the same forms). A group is
  either INT4 `pack-quantized` (symmetric, one scale per `group_size` inputs, no activation
  quantization: `weight_packed` int32 [N, K/8], `weight_scale` [N, K/group], `weight_shape`) or
  FP8 `float-quantized` with block scales (`weight` e4m3, `weight_scale` per block).

A field with a value we do not implement is refused with a ConfigError naming it: loading such
a checkpoint as if it were something else would serve garbage.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pegainfer.core.errors import ConfigError


@dataclass(frozen=True)
class StoredPart:
    """One tensor a quantized weight [N, K] is stored as (`<module>.<suffix>` in the
    checkpoint): each of its rows covers `rows_per` rows of the weight and each column
    `cols_per` columns (the last block may be partial), so it is
    [ceil(N / rows_per), ceil(K / cols_per)] of `dtype`."""

    suffix: str
    dtype: torch.dtype
    rows_per: int = 1
    cols_per: int = 1

    def shape(self, rows: int, cols: int) -> tuple[int, int]:
        return math.ceil(rows / self.rows_per), math.ceil(cols / self.cols_per)


@dataclass(frozen=True)
class Fp8Block:
    """float8 e4m3 weights with one float32 scale per `block` (rows, cols) of the weight:
    W[n, k] = weight[n, k] * scale[n // block[0], k // block[1]]. The scale's checkpoint name
    is `weight_scale_inv` (DeepSeek's) or `weight_scale` (compressed-tensors')."""

    block: tuple[int, int] = (128, 128)
    scale_suffix: str = "weight_scale_inv"

    @property
    def parts(self) -> tuple[StoredPart, ...]:
        rows, cols = self.block
        return (
            StoredPart("weight", torch.float8_e4m3fn),
            StoredPart(self.scale_suffix, torch.float32, rows, cols),
        )

    @property
    def alignment(self) -> tuple[int, int]:
        """A slice of the weight (tensor-parallel share, fused part) must start on these
        multiples of rows and columns (and end on one, or at the weight's end)."""
        return self.block

    def describe(self) -> str:
        return f"FP8 e4m3, {self.block[0]}x{self.block[1]} block scales"


@dataclass(frozen=True)
class Int4Group:
    """Symmetric INT4 weights, eight per int32 along K (low nibble first, each stored as value
    + 8), one scale per `group_size` consecutive inputs of a row:
    W[n, k] = (nibble(n, k) - 8) * scale[n, k // group_size]."""

    group_size: int = 32
    scale_dtype: torch.dtype = torch.bfloat16

    @property
    def parts(self) -> tuple[StoredPart, ...]:
        return (
            StoredPart("weight_packed", torch.int32, 1, 8),
            StoredPart("weight_scale", self.scale_dtype, 1, self.group_size),
        )

    @property
    def alignment(self) -> tuple[int, int]:
        return 1, self.group_size

    def describe(self) -> str:
        return f"INT4, groups of {self.group_size}"


WeightFormat = Fp8Block | Int4Group
#: The checkpoint tensor that states an INT4 weight's unpacked shape (checked, not kept).
INT4_SHAPE_SUFFIX = "weight_shape"


@dataclass(frozen=True)
class _Group:
    """Layers chosen by `targets` (minus the scheme's ignore list) stored as `format`."""

    targets: tuple[str, ...]
    format: WeightFormat


@dataclass(frozen=True)
class QuantScheme:
    """Which linear layers of a checkpoint are quantized, and how (`format_for`)."""

    method: str
    groups: tuple[_Group, ...]
    ignore: tuple[str, ...]
    #: transformers' matching (prefix at a module boundary, regex, suffix) for `ignore`, or
    #: compressed-tensors' (exact name, class name, or `re:` regex from the start).
    hf_matching: bool

    def format_for(self, module: str) -> WeightFormat | None:
        """How the linear layer `module` (its checkpoint name without `.weight`, e.g.
        `model.layers.0.self_attn.q_proj`) is stored; None: unquantized."""
        if any(self._matches(module, pattern) for pattern in self.ignore):
            return None
        for group in self.groups:
            if any(_ct_match(module, target) for target in group.targets):
                return group.format
        return None

    def common_format(self, modules: Iterable[str]) -> WeightFormat | None:
        """The one format of checkpoint layers that become one fused or stacked weight
        (q/k/v, gate/up, a bank of experts); a ConfigError if they are stored differently."""
        formats = {module: self.format_for(module) for module in modules}
        if len(set(formats.values())) > 1:
            shown = ", ".join(f"{m}: {f.describe() if f else 'unquantized'}"
                              for m, f in formats.items())  # fmt: skip
            raise ConfigError(
                f"quantization_config stores layers that run as one matrix differently ({shown})"
            )
        return next(iter(formats.values()), None)

    def _matches(self, module: str, pattern: str) -> bool:
        return _hf_match(module, pattern) if self.hf_matching else _ct_match(module, pattern)


def _hf_match(module: str, pattern: str) -> bool:
    """transformers' `should_convert_module`: `pattern` matches from the start up to a module
    boundary (as a regular expression), or is a suffix of the name."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return bool(re.match(rf"(?:{pattern}){boundary}", module)) or module.endswith(pattern)


def _ct_match(module: str, target: str) -> bool:
    """compressed-tensors' matching for the layers we build: `re:` + a regular expression
    matched at the start of the name, the class name `Linear` (every layer asked about is
    one), or the exact name."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target in ("Linear", module)


def parse_quantization(config: dict[str, Any]) -> QuantScheme | None:
    """The scheme of a checkpoint's config.json (None: not quantized)."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError("quantization_config must be an object")
    method = qc.get("quant_method")
    if method == "fp8":
        return _parse_fp8(qc)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    raise ConfigError(
        f"quantization_config.quant_method {method!r} is not supported "
        "(supported: 'fp8' with weight_block_size, 'compressed-tensors')"
    )


def _refuse(field: str, value: Any, supported: str) -> ConfigError:
    return ConfigError(
        f"quantization_config.{field} = {value!r} is not supported (supported: {supported})"
    )


def _known_fields(mapping: dict[str, Any], known: set[str], where: str) -> None:
    """Refuse fields we do not know: one could change what the stored tensors mean."""
    if unknown := sorted(set(mapping) - known):
        raise ConfigError(f"{where} has fields pegainfer does not know: {unknown}")


def _patterns(value: Any, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise ConfigError(f"quantization_config.{field} must be a list of names")
    for pattern in value:
        try:
            re.compile(pattern.removeprefix("re:"))
        except re.error as exc:
            message = f"quantization_config.{field}: bad pattern {pattern!r}: {exc}"
            raise ConfigError(message) from exc
    return tuple(value)


# Fields of `quant_method: fp8` that do not change how the weights are stored or used.
_FP8_KEYS = {"quant_method", "fmt", "activation_scheme", "weight_block_size",
             "modules_to_not_convert", "ignored_layers", "scale_fmt", "dequantize",
             "expert_dtype", "modules_to_convert"}  # fmt: skip


def _parse_fp8(qc: dict[str, Any]) -> QuantScheme:
    _known_fields(qc, _FP8_KEYS, "quantization_config")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse("fmt", qc["fmt"], "'e4m3'")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse("activation_scheme", qc["activation_scheme"], "'dynamic'")
    # ue8m0: the scales are powers of two (DeepSeek-V3.1 writes them as float32, transformers
    # as float8_e8m0fnu); either is read exactly into our float32 scales.
    if qc.get("scale_fmt", "float") not in ("float", "ue8m0"):
        raise _refuse("scale_fmt", qc["scale_fmt"], "'float', 'ue8m0'")
    if qc.get("expert_dtype", "fp8") != "fp8":
        raise _refuse("expert_dtype", qc["expert_dtype"], "'fp8'")
    if qc.get("dequantize", False):
        raise _refuse("dequantize", qc["dequantize"], "false")
    if qc.get("modules_to_convert"):
        raise _refuse("modules_to_convert", qc["modules_to_convert"], "none (linear layers only)")
    block = qc.get("weight_block_size")
    if block is None:
        raise ConfigError(
            "quantization_config.weight_block_size is missing: per-tensor FP8 is not supported, "
            "only block scales"
        )
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):  # fmt: skip
        raise _refuse("weight_block_size", block, "two positive integers")
    ignore_field = "modules_to_not_convert" if "modules_to_not_convert" in qc else "ignored_layers"
    ignore = qc.get(ignore_field)
    # Without a list transformers leaves the LM head alone (its default skip).
    patterns = ("lm_head",) if ignore is None else _patterns(ignore, ignore_field)
    group = _Group(("Linear",), Fp8Block((block[0], block[1])))
    return QuantScheme("fp8", (group,), patterns, hf_matching=True)


_CT_KEYS = {"quant_method", "format", "quantization_status", "kv_cache_scheme", "config_groups",
            "ignore", "global_compression_ratio", "sparsity_config", "transform_config",
            "version", "provider"}  # fmt: skip
_CT_GROUP_KEYS = {"targets", "weights", "input_activations", "output_activations", "format"}
# Calibration settings: how the scales were chosen, not how they are stored or used.
_CT_CALIBRATION = {"observer", "observer_kwargs"}


def _parse_compressed_tensors(qc: dict[str, Any]) -> QuantScheme:
    _known_fields(qc, _CT_KEYS, "quantization_config")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise _refuse("quantization_status", qc["quantization_status"], "'compressed'")
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(field):
            raise _refuse(field, qc[field], "null")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError("quantization_config.config_groups must name at least one group")
    parsed = tuple(
        _parse_ct_group(f"config_groups.{name}", group, qc.get("format"))
        for name, group in groups.items()
    )
    return QuantScheme("compressed-tensors", parsed, _patterns(qc.get("ignore"), "ignore"),
                       hf_matching=False)  # fmt: skip


def _parse_ct_group(where: str, group: Any, default_format: str | None) -> _Group:
    if not isinstance(group, dict):
        raise ConfigError(f"quantization_config.{where} must be an object")
    _known_fields(group, _CT_GROUP_KEYS, f"quantization_config.{where}")
    targets = _patterns(group.get("targets"), f"{where}.targets")
    if not targets:
        raise ConfigError(f"quantization_config.{where}.targets is empty")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise ConfigError(f"quantization_config.{where}.weights must be an object")
    if group.get("output_activations"):
        raise _refuse(f"{where}.output_activations", group["output_activations"], "null")
    fmt = group.get("format") or default_format
    w = {key: value for key, value in weights.items() if key not in _CT_CALIBRATION}

    def expect(key: str, allowed: tuple[Any, ...], default: Any = None) -> Any:
        value = w.get(key, default)
        if value not in allowed:
            raise _refuse(f"{where}.weights.{key}", value, ", ".join(map(repr, allowed)))
        return value

    expect("symmetric", (True,), True)
    expect("dynamic", (False,), False)
    for key in ("actorder", "zp_dtype", "scale_dtype"):
        expect(key, (None,))
    known = {"num_bits", "type", "symmetric", "strategy", "group_size", "dynamic", "actorder",
             "block_structure", "zp_dtype", "scale_dtype"}  # fmt: skip
    _known_fields(w, known, f"quantization_config.{where}.weights")
    if fmt == "pack-quantized":
        expect("num_bits", (4,))
        expect("type", ("int",))
        expect("strategy", ("group",))
        expect("block_structure", (None,))
        size = w.get("group_size")
        if not isinstance(size, int) or size <= 0 or size % 8:
            raise _refuse(f"{where}.weights.group_size", size, "a positive multiple of 8")
        if group.get("input_activations"):
            raise _refuse(f"{where}.input_activations", group["input_activations"],
                          "null (weight-only INT4)")  # fmt: skip
        return _Group(targets, Int4Group(size))
    if fmt == "float-quantized":
        expect("num_bits", (8,))
        expect("type", ("float",))
        expect("strategy", ("block",))
        expect("group_size", (None,))
        block = w.get("block_structure")
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):  # fmt: skip
            raise _refuse(f"{where}.weights.block_structure", block, "two positive integers")
        _check_fp8_activations(where, group.get("input_activations"))
        return _Group(targets, Fp8Block((block[0], block[1]), scale_suffix="weight_scale"))
    raise _refuse(f"{where}.format" if group.get("format") else "format", fmt,
                  "'pack-quantized' (INT4 groups), 'float-quantized' (FP8 blocks)")  # fmt: skip


def _check_fp8_activations(where: str, acts: Any) -> None:
    """FP8 block weights run with activations quantized per token and group of 128 on the fly
    (or not at all): what our kernels do. A static scale would be a tensor we do not load."""
    if acts is None:
        return
    if not isinstance(acts, dict):
        raise ConfigError(f"quantization_config.{where}.input_activations must be an object")
    settings = {k: v for k, v in acts.items() if k not in _CT_CALIBRATION}
    expected = {"num_bits": 8, "type": "float", "dynamic": True, "symmetric": True}
    for key, value in expected.items():
        if settings.get(key, value) != value:
            raise _refuse(f"{where}.input_activations.{key}", settings.get(key), repr(value))
    strategy = settings.get("strategy")
    if strategy not in ("group", "token"):
        raise _refuse(f"{where}.input_activations.strategy", strategy, "'group', 'token'")
