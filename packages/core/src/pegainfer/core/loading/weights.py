"""Loading safetensors checkpoints into a model's parameters.

The line maps each checkpoint tensor name to a parameter and a row offset in it (so q/k/v can
land in one fused qkv matrix); this module reads the files (sharded or not, memory-mapped),
converts dtypes, checks shapes, and proves every parameter row was written exactly once.
The memory maps are closed file by file, so nothing of the checkpoint stays mapped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from pegainfer.core.errors import WeightLoadError

if TYPE_CHECKING:
    from pegainfer.core.model_line import ModelContext

INDEX_FILE = "model.safetensors.index.json"


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

    def select(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of the checkpoint tensor this rank keeps (a view)."""
        if self.rows is not None:
            tensor = tensor[self.rows[0] : self.rows[1]]
        if self.cols is not None:
            tensor = tensor[:, self.cols[0] : self.cols[1]]
        return tensor


# A checkpoint tensor goes to one place, to several (parts of it into different rows, as a
# tensor-parallel rank's share of a fused matrix can be), or nowhere (None).
NameMap = Callable[[str], WeightTarget | list[WeightTarget] | None]
M = TypeVar("M", bound=torch.nn.Module)


def empty_param(*shape: int, dtype: torch.dtype | None = None) -> torch.nn.Parameter:
    """A frozen parameter to be filled from a checkpoint (models are built on the meta device,
    so this allocates nothing until `allocate_parameters`). With `dtype` it keeps that dtype
    whatever the model's (a router's float32 correction bias: `build_and_load`)."""
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


def iter_tensors(files: list[Path], progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every (name, tensor) of `files`; tensors are views of the file's memory map."""
    for path in tqdm(files, desc="Loading weights", unit="file", disable=not progress):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, f.get_tensor(name)
        except SafetensorError as exc:
            raise WeightLoadError(f"cannot read {path}: {exc}") from exc


def load_weights(
    params: dict[str, torch.Tensor],
    model_dir: Path,
    name_map: NameMap,
    progress: bool = True,
) -> None:
    """Fill `params` from the checkpoint in `model_dir`, converting to each parameter's dtype."""
    written: dict[str, int] = dict.fromkeys(params, 0)
    with torch.no_grad():
        for name, full in iter_tensors(checkpoint_files(model_dir), progress):
            targets = name_map(name)
            for target in [targets] if isinstance(targets, WeightTarget) else targets or []:
                _write(params, written, name, full, target)
    _check_complete(params, written, model_dir)


def _write(
    params: dict[str, torch.Tensor],
    written: dict[str, int],
    name: str,
    full: torch.Tensor,
    target: WeightTarget,
) -> None:
    """Copy the part of checkpoint tensor `name` that `target` selects into its parameter."""
    param = params.get(target.param)
    if param is None:
        raise WeightLoadError(
            f"checkpoint tensor {name!r} maps to unknown parameter {target.param!r}"
        )
    tensor = target.select(full)
    region = param
    if target.num_rows is not None:
        region = param[target.row_offset : target.row_offset + target.num_rows]
    if tuple(region.shape) != tuple(tensor.shape):
        raise WeightLoadError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, but parameter "
            f"{target.param!r} expects {tuple(region.shape)}"
        )
    region.copy_(tensor)
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


def build_and_load(make: Callable[[], M], ctx: ModelContext) -> M:
    """A line's model: built by `make` on the meta device in `ctx.dtype` (no memory, no random
    init; parameters made with a dtype of their own keep it), given storage on `ctx.device`,
    then filled from the checkpoint through the model's
    `checkpoint_name_map`."""
    with torch.device("meta"):
        model = make().to(ctx.dtype)
    _restore_kept_dtypes(model)
    allocate_parameters(model, ctx.device)
    load_weights(dict(model.named_parameters()), ctx.model_dir, model.checkpoint_name_map)
    return model
