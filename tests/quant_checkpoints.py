"""Quantized copies of tiny checkpoints, in the real layouts, for every line's tests: FP8 with
block scales (`quant_method: fp8`, DeepSeek/Qwen3-FP8) or compressed-tensors INT4 groups;
each with a twin holding the exactly dequantized weights (float32, no quantization_config),
which an unquantized model must match bit for bit. Also the fix transformers 5.23 needs to
dequantize FP8 weights whose shape is not a multiple of the block (see the Kimi/GLM note)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pegainfer.core.model import Model
from pegainfer.core.ops import quant as ref
from pegainfer.core.quant.scheme import INT4_SHAPE_SUFFIX, Fp8Block, Int4Group, parse_quantization
from tests.paged_runner import PagedRunner

FP8_BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}  # fmt: skip


def int4_config(ignore: list[str], group_size: int = 32) -> dict[str, Any]:
    """compressed-tensors' pack-quantized INT4 config (Kimi-K2-Thinking's, with `ignore`)."""
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": group_size, "dynamic": False, "actorder": None,
               "block_structure": None, "observer": "minmax", "observer_kwargs": {}}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None,
                                          "output_activations": None}},
            "ignore": ignore}  # fmt: skip


def quantize_checkpoint(
    src: Path,
    dst: Path,
    quantization_config: dict[str, Any],
    is_linear: Callable[[str], bool],
    dequantized: Path | None = None,
) -> None:
    """Copy checkpoint `src` to `dst` with every linear layer (`is_linear(module)`) that
    `quantization_config` quantizes stored that way; `dequantized`: also write the twin."""
    scheme = parse_quantization({"quantization_config": quantization_config})
    assert scheme is not None
    quantized: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            module, _, leaf = name.rpartition(".")
            fmt = scheme.format_for(module) if leaf == "weight" and is_linear(module) else None
            if fmt is None:
                quantized[name] = plain[name] = tensor
                continue
            if isinstance(fmt, Fp8Block):
                q, scale = ref.quantize_fp8_block(tensor, fmt.block)
                plain[name] = ref.dequantize_fp8_block(q, scale, fmt.block, torch.float32)
            elif isinstance(fmt, Int4Group):
                q, scale = ref.quantize_int4_group(tensor, fmt.group_size, fmt.scale_dtype)
                plain[name] = ref.dequantize_int4_group(q, scale, fmt.group_size, torch.float32)
                quantized[f"{module}.{INT4_SHAPE_SUFFIX}"] = torch.tensor(tensor.shape)
            for part, value in zip(fmt.parts, (q, scale), strict=True):
                quantized[f"{module}.{part.suffix}"] = value
    config = json.loads((src / "config.json").read_text())
    for out, tensors, qc in ((dst, quantized, quantization_config), (dequantized, plain, None)):
        if out is None:
            continue
        shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors*"),
                        dirs_exist_ok=True)  # fmt: skip
        save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
        written = {k: v for k, v in config.items() if k != "quantization_config"}
        if qc is not None:
            written["quantization_config"] = qc
        (out / "config.json").write_text(json.dumps(written, indent=2))


@contextmanager
def hf_fp8_ceil_blocks() -> Iterator[None]:
    """Make transformers 5.23 dequantize FP8 weights with the configured block size and ceil
    blocks (it divides the weight's shape by the scale grid: wrong, or an error, when the
    shape is not a multiple of the block)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    original = Fp8Dequantize._dequantize_one

    def ceil_blocks(self, quantized, scales, output_dtype=None):
        block = tuple(self.hf_quantizer.quantization_config.weight_block_size)
        if quantized.dtype != ref.FP8:
            return original(self, quantized, scales, output_dtype)
        return ref.dequantize_fp8_block(quantized, scales, block, output_dtype or torch.bfloat16)

    Fp8Dequantize._dequantize_one = ceil_blocks
    try:
        yield
    finally:
        Fp8Dequantize._dequantize_one = original


def assert_equals_the_dequantized_twin(
    quantized: Model, twin: Model, original: Model, tokens: list[int]
) -> None:
    """A model on quantized weights computes bit for bit what one on their exact
    dequantization (`twin`) does, and not what the unquantized `original` does (else the
    comparisons with transformers could pass on the original weights)."""
    logits = PagedRunner(quantized).step({"a": tokens})["a"]
    assert torch.equal(logits, PagedRunner(twin).step({"a": tokens})["a"])
    assert (logits - PagedRunner(original).step({"a": tokens})["a"]).abs().max() > 1e-3


def stored_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor a sharded checkpoint stores, by name, as stored."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(path / file, "pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    return tensors
