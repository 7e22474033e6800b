"""Loading safetensors checkpoints into a model's parameters.

The line maps each checkpoint tensor name to a parameter and a row offset in it (so q/k/v can
land in one fused qkv matrix); this module walks the files' headers (sharded or not:
`safetensors_index.py`), checks dtypes and shapes, queues the bytes each parameter needs (only
those: a tensor-parallel rank's rows, nothing of an unmapped tensor) and proves every
parameter row was written exactly once. The bytes are read by several threads and go to the
device through page-locked staging buffers (`staging.py`); dtypes convert on the device.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from pegainfer.core.errors import ConfigError, WeightLoadError
from pegainfer.core.loading.safetensors_index import StoredTensor, read_index
from pegainfer.core.loading.staging import CheckpointCopies
from pegainfer.core.quant.scheme import (
    INT4_SHAPE_SUFFIX,
    Int4Group,
    QuantScheme,
    StoredPart,
    WeightFormat,
    parse_quantization,
)

if TYPE_CHECKING:
    from pegainfer.core.model import ModelContext

INDEX_FILE = "model.safetensors.index.json"
#: Dtypes only a quantized layer's parameters have (float8 weights, packed INT4 words).
QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int32)


@dataclass(frozen=True)
class WeightTarget:
    """Where a checkpoint tensor goes: the whole of `param`, or `num_rows` rows of it
    starting at `row_offset` (one shard of a fused matrix). With tensor parallelism a rank
    keeps only `rows` or `cols` ([start, end)) of the checkpoint tensor."""

    param: str
    row_offset: int = 0
    num_rows: int | None = None
    rows: tuple[int, int] | None = None
    cols: tuple[int, int] | None = None

    def select(
        self, name: str, shape: tuple[int, ...]
    ) -> tuple[tuple[int, int] | None, tuple[int, int] | None, tuple[int, ...]]:
        """The rows and columns of checkpoint tensor `name` (of `shape`) this rank keeps,
        bounded as slices bound them, and the shape they make."""
        rows = cols = None
        if self.rows is not None:
            if not shape:
                raise WeightLoadError(f"checkpoint tensor {name!r} is a scalar: no rows to select")
            kept = range(shape[0])[self.rows[0] : self.rows[1]]
            rows, shape = (kept.start, kept.stop), (len(kept), *shape[1:])
        if self.cols is not None:
            if len(shape) < 2:
                raise WeightLoadError(f"checkpoint tensor {name!r} has no columns to select")
            kept = range(shape[1])[self.cols[0] : self.cols[1]]
            cols, shape = (kept.start, kept.stop), (shape[0], len(kept), *shape[2:])
        return rows, cols, shape


# A checkpoint tensor goes to one place, to several (parts of it into different rows, as a
# tensor-parallel rank's share of a fused matrix can be), or nowhere (None).
NameMap = Callable[[str], WeightTarget | list[WeightTarget] | None]
M = TypeVar("M", bound=torch.nn.Module)


def empty_param(*shape: int, dtype: torch.dtype | None = None) -> torch.nn.Parameter:
    """A frozen parameter to be filled from a checkpoint (models are built on the meta device,
    so this allocates nothing until `allocate_parameters`). With `dtype` it keeps that dtype
    whatever the model's (a quantized layer's tensors, a router's float32 correction bias:
    `build_and_load`)."""
    param = torch.nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.kept_dtype = dtype
    return param


def _restore_kept_dtypes(module: torch.nn.Module) -> None:
    """Undo a whole-model `.to(dtype)` for the parameters made with a `dtype` of their own."""
    for sub in module.modules():
        for name, param in sub._parameters.items():
            kept = getattr(param, "kept_dtype", None)
            if kept is not None and param.dtype != kept:
                restored = torch.nn.Parameter(param.to(kept), requires_grad=False)
                restored.kept_dtype = kept
                sub._parameters[name] = restored


def allocate_parameters(module: torch.nn.Module, device: torch.device) -> None:
    """Give a module built on the meta device uninitialised storage on `device`, in place.

    `Module.to_empty` does the same but goes through torch's reference ops, which import
    sympy: seconds of start-up and tens of MB resident for nothing.
    """
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                storage = torch.empty(param.shape, dtype=param.dtype, device=device)
                sub._parameters[name] = torch.nn.Parameter(storage, requires_grad=False)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from its index when it is sharded."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightLoadError(f"{INDEX_FILE} names files missing from {model_dir}: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors weight files in {model_dir}")
    return files


def load_weights(
    params: dict[str, torch.Tensor],
    model_dir: Path,
    name_map: NameMap,
    progress: bool = True,
    scheme: QuantScheme | None = None,
) -> None:
    """Fill `params` from the checkpoint in `model_dir`, converting to each parameter's dtype.

    With a quantization `scheme`, a quantized linear layer's stored tensors (`<module>.weight` and
    its scales, or `weight_packed`/`weight_scale`) go to the parameters of the same suffixes
    under the one `name_map` gives for `<module>.weight` (a `QuantLinear` there), at the rows
    and columns the weight's own target selects, scaled to each tensor's blocks; they keep
    their dtype (scales widen to float32 exactly), and a selection that cuts a block is
    refused."""
    written: dict[str, int] = dict.fromkeys(params, 0)
    int4_shapes = _Int4Shapes()
    devices = {param.device for param in params.values()}
    device = devices.pop() if len(devices) == 1 else torch.device("cpu")
    stored_tensors = [t for path in checkpoint_files(model_dir) for t in read_index(path)]
    with torch.no_grad(), CheckpointCopies(device, progress=progress) as copies:
        for full in stored_tensors:
            name = full.name
            module, fmt, part = _quantized_part(name, scheme)
            mapped = name_map(f"{module}.weight" if fmt is not None else name)
            targets = [mapped] if isinstance(mapped, WeightTarget) else mapped or []
            if fmt is not None and part is None:  # INT4's weight_shape: checked, not kept
                if targets:
                    int4_shapes.declared[module] = tuple(copies.read(full).tolist())
                continue
            for target in targets:
                # A plain parameter: a layer the scheme's targets name but that is no linear
                # layer of the model (a norm, the embedding), or one the line built unquantized
                # (`_write` refuses a quantized tensor there).
                if fmt is None or target.param in params:
                    if part is not None and part != fmt.parts[0]:
                        raise WeightLoadError(
                            f"checkpoint tensor {name!r} holds scales of a quantized weight, "
                            f"but the model built {target.param!r} unquantized"
                        )
                    _write(params, written, full, target, copies)
                    continue
                stored = _stored_target(params, name, full, target, fmt, part)
                if part == fmt.parts[0] and isinstance(fmt, Int4Group):
                    int4_shapes.packed[module] = (full.shape[0], full.shape[1] * part.cols_per)
                _write(params, written, full, stored, copies, part=part)
    _check_complete(params, written, model_dir)
    int4_shapes.check(model_dir)


@dataclass
class _Int4Shapes:
    """Each INT4 weight's `weight_shape` against the shape its packed tensor implies."""

    declared: dict[str, tuple[int, ...]] = field(default_factory=dict)
    packed: dict[str, tuple[int, int]] = field(default_factory=dict)

    def check(self, model_dir: Path) -> None:
        for module in sorted(set(self.declared) | set(self.packed)):
            declared, packed = self.declared.get(module), self.packed.get(module)
            if declared != packed:
                raise WeightLoadError(
                    f"checkpoint in {model_dir}: {module}.{INT4_SHAPE_SUFFIX} is {declared}, "
                    f"but {module}.weight_packed holds a weight of shape {packed}"
                )


def _quantized_part(
    name: str, scheme: QuantScheme | None
) -> tuple[str, WeightFormat | None, StoredPart | None]:
    """(module, its format, the stored part `name` is) for a quantized layer's tensor (part
    None: INT4's weight_shape); (name, None, None) for anything else."""
    module, _, suffix = name.rpartition(".")
    fmt = scheme.format_for(module) if scheme is not None and module else None
    if fmt is not None:
        for part in fmt.parts:
            if part.suffix == suffix:
                return module, fmt, part
        if isinstance(fmt, Int4Group) and suffix == INT4_SHAPE_SUFFIX:
            return module, fmt, None
    return name, None, None


def _stored_target(
    params: dict[str, torch.Tensor],
    name: str,
    full: StoredTensor,
    target: WeightTarget,
    fmt: WeightFormat,
    part: StoredPart,
) -> WeightTarget:
    """Where stored tensor `name` (a `part` of a weight in `fmt`) goes, given the weight's own
    `target` in element rows and columns; the weight's tensor checks that no selection or
    fused offset cuts a block."""
    param = f"{target.param}.{part.suffix}"
    if param not in params:
        raise WeightLoadError(
            f"checkpoint tensor {name!r} is stored as {fmt.describe()} (quantization_config), "
            f"but the model built {target.param!r} without that format"
        )
    if part == fmt.parts[0]:
        rows, cols = full.shape[0] * part.rows_per, full.shape[1] * part.cols_per
        param_rows = params[param].shape[0] * part.rows_per
        _check_aligned(name, target, fmt.alignment, rows, cols, param_rows)

    def span(bounds: tuple[int, int] | None, unit: int) -> tuple[int, int] | None:
        return None if bounds is None else (bounds[0] // unit, -(-bounds[1] // unit))

    unit = part.rows_per
    num_rows = None
    if target.num_rows is not None:
        num_rows = -(-(target.row_offset + target.num_rows) // unit) - target.row_offset // unit
    rows, cols = span(target.rows, unit), span(target.cols, part.cols_per)
    return WeightTarget(param, target.row_offset // unit, num_rows, rows=rows, cols=cols)


def _check_aligned(
    name: str,
    target: WeightTarget,
    alignment: tuple[int, int],
    rows: int,
    cols: int,
    param_rows: int,
) -> None:
    """Refuse a tensor-parallel share or a fused part of a quantized weight that starts or ends
    inside one of its blocks (ending at the weight's or the parameter's end is fine)."""
    spans = [("rows", target.rows, alignment[0], rows),
             ("columns", target.cols, alignment[1], cols)]  # fmt: skip
    if target.num_rows is not None:
        end = target.row_offset + target.num_rows
        spans.append(("rows of the fused parameter", (target.row_offset, end), alignment[0],
                      param_rows))  # fmt: skip
    for what, bounds, unit, size in spans:
        if bounds is None:
            continue
        start, end = bounds
        if start % unit or (end % unit and end != size):
            raise WeightLoadError(
                f"checkpoint tensor {name!r}: {what} [{start}, {end}) of {size} cut its "
                f"quantization blocks of {unit}; choose a tensor-parallel size (or fused "
                "layout) that splits on block boundaries"
            )


# Widening a stored scale to our float32 scales is exact from these.
_EXACT_INTO_FLOAT32 = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu)


def _write(
    params: dict[str, torch.Tensor],
    written: dict[str, int],
    full: StoredTensor,
    target: WeightTarget,
    copies: CheckpointCopies,
    part: StoredPart | None = None,
) -> None:
    """Queue the part of checkpoint tensor `full` that `target` selects for its parameter."""
    name = full.name
    param = params.get(target.param)
    if param is None:
        raise WeightLoadError(
            f"checkpoint tensor {name!r} maps to unknown parameter {target.param!r}"
        )
    if part is not None:
        exact = full.dtype == param.dtype or (
            param.dtype == torch.float32 and full.dtype in _EXACT_INTO_FLOAT32
        )
        if not exact:
            raise WeightLoadError(
                f"checkpoint tensor {name!r} is {full.dtype}, but quantization_config stores it "
                f"as {part.dtype}"
            )
    elif full.dtype in QUANTIZED_DTYPES and full.dtype != param.dtype:
        raise WeightLoadError(
            f"checkpoint tensor {name!r} is quantized ({full.dtype}), but the model built "
            f"{target.param!r} unquantized: the checkpoint's quantization_config does not "
            "quantize it, or the model line does not load it quantized"
        )
    rows, cols, shape = target.select(name, full.shape)
    region = param
    if target.num_rows is not None:
        region = param[target.row_offset : target.row_offset + target.num_rows]
    if tuple(region.shape) != shape:
        raise WeightLoadError(
            f"checkpoint tensor {name!r} has shape {shape}, but parameter "
            f"{target.param!r} expects {tuple(region.shape)}"
        )
    copies.copy(region, full, rows, cols)
    written[target.param] += region.shape[0] if region.dim() > 0 else 1


def _check_complete(
    params: dict[str, torch.Tensor], written: dict[str, int], model_dir: Path
) -> None:
    missing, duplicated = [], []
    for name, param in params.items():
        expected = param.shape[0] if param.dim() > 0 else 1
        if written[name] < expected:
            missing.append(name)
        elif written[name] > expected:
            duplicated.append(name)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise WeightLoadError(
            f"checkpoint in {model_dir} lacks {len(missing)} tensor(s) the model needs: {shown}"
        )
    if duplicated:
        raise WeightLoadError(
            f"checkpoint in {model_dir} writes these parameters twice: {duplicated}"
        )


def meta_model(make: Callable[[], M], dtype: torch.dtype) -> M:
    """The model `make` builds, on the meta device in `dtype` (no memory, no random init;
    parameters made with a dtype of their own keep it: a quantized layer's, a router's
    float32 correction bias)."""
    with torch.device("meta"):
        model = make().to(dtype)
    _restore_kept_dtypes(model)
    return model


def build_and_load(make: Callable[[], M], ctx: ModelContext) -> M:
    """A line's model: built by `make` on the meta device (`meta_model`), given storage on
    `ctx.device`, then filled from the checkpoint through the model's `checkpoint_name_map`
    (quantized layers as `quantization_config` says: `core.quant`), or with random values in
    place (`ctx.random_weights`)."""
    model = meta_model(make, ctx.dtype)
    scheme = parse_quantization(ctx.config)
    params = dict(model.named_parameters())
    if scheme is not None and not any(p.dtype in QUANTIZED_DTYPES for p in params.values()):
        raise ConfigError(
            f"{type(model).__name__} has no quantized layers, but the checkpoint's "
            f"quantization_config stores weights as {scheme.method}: this model line does not "
            "load quantized checkpoints"
        )
    allocate_parameters(model, ctx.device)
    if ctx.random_weights:
        from pegainfer.core.loading.random_fill import fill_random

        fill_random(model)
    else:
        load_weights(dict(model.named_parameters()), ctx.model_dir, model.checkpoint_name_map,
                     scheme=scheme)  # fmt: skip
    from pegainfer.core.model import Model  # it imports (through quant.linear) this module

    if isinstance(model, Model):
        model.after_loading()
    return model
