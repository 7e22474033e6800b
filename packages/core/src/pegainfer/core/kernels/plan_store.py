"""Kernel plans compiled into Triton's cache, remembered beside it (issue 21).

A start whose plan (the line, its checkpoint's config, the layout, the step bounds, and the
source of every pegainfer module, which decides what the steps launch) was compiled before into
this cache by this Triton for this GPU architecture reads the plan's launches from here: it
records nothing (a meta forward per step, seconds for a MoE line) and spawns no compile
processes (each would import torch to load what the cache holds). An empty cache (a fresh
machine) has no entry, and any change to those inputs names another one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from pegainfer.core.kernels.precompile import KernelLaunch, TensorArg

logger = logging.getLogger(__name__)

_TENSOR = "tensor"


@functools.cache
def _source_digest() -> str:
    """A hash of every pegainfer module's source (core and each installed line)."""
    import pegainfer

    digest = hashlib.sha256()
    for root in sorted(pegainfer.__path__):
        for path in sorted(Path(root).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def plan_path(plan_inputs: str, device: torch.device) -> Path:
    """Where the launches of the plan made from `plan_inputs` (a description of everything
    the plan depends on besides the code) are remembered for `device`."""
    import triton
    from triton import knobs

    gpu = device.type == "cuda" and torch.cuda.is_available()
    target = (triton.__version__, torch.cuda.get_device_capability(device) if gpu else None)
    key = repr((plan_inputs, target, _source_digest()))
    return (
        Path(knobs.cache.dir)
        / "pegainfer-plans"
        / f"{hashlib.sha256(key.encode()).hexdigest()}.json"
    )


def _encode(value: Any) -> Any:
    if isinstance(value, TensorArg):
        return {_TENSOR: str(value.dtype).removeprefix("torch."), "offset": value.offset}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"a launch argument of type {type(value).__name__} is not stored")


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        return TensorArg(getattr(torch, value[_TENSOR]), value["offset"])
    return value


def store(path: Path, launches: tuple[KernelLaunch, ...]) -> None:
    """Remember `launches`, all compiled into the cache (a plan with an argument JSON cannot
    hold is not remembered: the next start records it again)."""
    try:
        entries = [{"module": launch.module, "name": launch.name,
                    "args": [_encode(a) for a in launch.args],
                    "kwargs": [[k, _encode(v)] for k, v in launch.kwargs]}
                   for launch in launches]  # fmt: skip
    except TypeError as error:
        logger.info("the kernel plan is not remembered: %s", error)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(entries))
    temporary.replace(path)  # whole or absent, for a start reading it meanwhile


def load(path: Path) -> tuple[KernelLaunch, ...] | None:
    """The launches remembered at `path`, or None."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return tuple(
        KernelLaunch(entry["module"], entry["name"], tuple(_decode(a) for a in entry["args"]),
                     tuple((k, _decode(v)) for k, v in entry["kwargs"]))
        for entry in entries
    )  # fmt: skip
