"""Read-then-overwrite races inside one program of a Triton kernel, found on the CPU.

A tensor with fewer elements than the program has threads (or a scalar) is held by several
threads at once; every copy loads it and only one stores it. When a program loads from memory
and later stores to the same addresses, a thread still to issue its load may read what another
thread of the program has already stored, unless a barrier lies between the load and the
store. Triton's interpreter runs each program as a whole and cannot show this; the kernel
compiled for a GPU target (which needs no GPU) shows it in its TTGIR, where every tensor carries
the layout that says how many threads hold each element.

The check is for straight-line kernels (no `scf` loops: a store in one iteration and a load in
the next would need more than an ordered scan) and sees a load and a store of the same
addresses only when they use the same pointer value, which Triton's CSE makes of one pointer
expression used twice.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

_BLOCKED = re.compile(
    r"^#(\w+) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\], threadsPerWarp = \[([\d, ]+)\], "
    r"warpsPerCTA = \[([\d, ]+)\]"
)
_LOAD = re.compile(r"= tt\.load (%[\w.]+)\b.*? : (.+?) loc\(")
_STORE = re.compile(r"tt\.store (%[\w.]+),.*? : (.+?) loc\(")
_TENSOR = re.compile(r"tensor<([\dx]+)x!tt\.ptr<\w+>, #(\w+)>")


def compile_ttgir(
    fn: Any,
    args: Mapping[str, str | int],
    constants: Mapping[str, Any],
    num_warps: int,
    arch: int = 90,
) -> str:
    """The TTGIR of `fn` (a @triton.jit function) compiled for NVIDIA sm_`arch` as a launch
    would specialize it: `args` gives each runtime argument's Triton type ("*bf16", "fp32") or,
    for an integer, its value (i32, marked divisible by 16 where it is); pointers count as
    16-byte aligned unless `fn` declines to specialize them on alignment. The layouts Triton
    picks follow from these (a vector load needs the alignment)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    unaligned = set(fn.do_not_specialize_on_alignment or ())
    types, attrs = {}, {}
    for index, name in enumerate(names):
        arg = constants.get(name, args.get(name))
        if name in constants:
            types[name] = "constexpr"
        elif isinstance(arg, int):
            types[name] = "i32"
            divisible = arg % 16 == 0
        else:
            types[name] = arg
            divisible = arg.startswith("*") and name not in unaligned and index not in unaligned
        if name not in constants and divisible:
            attrs[(index,)] = [["tt.divisibility", 16]]
    values = {(names.index(name),): value for name, value in constants.items()}
    source = ASTSource(fn, types, constexprs=values, attrs=attrs)
    target = GPUTarget("cuda", arch, 32)
    return triton.compile(source, target=target, options={"num_warps": num_warps}).asm["ttgir"]


def _held_by_several_threads(type_text: str, layouts: dict[str, list[int]]) -> bool:
    """Whether a load of this pointer type gives some element to more than one thread: a
    scalar always; a tensor when its layout's tile (per dimension: elements per thread x
    threads per warp x warps) is larger than its shape. Layouts other than blocked count as
    replicated."""
    tensor = _TENSOR.search(type_text)
    if tensor is None:
        return True
    shape = [int(n) for n in tensor.group(1).split("x")]
    tile = layouts.get(tensor.group(2))
    return tile is None or any(t > n for t, n in zip(tile, shape, strict=True))


def in_place_hazards(ttgir: str) -> list[str]:
    """The stores of a straight-line kernel to addresses the program loaded, through a layout
    that holds an element in several threads, with no barrier since that load (each as its
    TTGIR line)."""
    assert "scf.for" not in ttgir and "scf.while" not in ttgir, "a straight-line kernel only"
    layouts: dict[str, list[int]] = {}
    pending: set[str] = set()  # pointers loaded by several threads since the last barrier
    hazards = []
    for line in ttgir.splitlines():
        text = line.strip()
        if blocked := _BLOCKED.match(text):
            per_dim = [[int(n) for n in g.split(",")] for g in blocked.groups()[1:]]
            layouts[blocked.group(1)] = [math.prod(d) for d in zip(*per_dim, strict=True)]
        elif "barrier" in text.split(" ")[0]:
            pending.clear()
        elif load := _LOAD.search(text):
            if _held_by_several_threads(load.group(2), layouts):
                pending.add(load.group(1))
        elif (store := _STORE.search(text)) and store.group(1) in pending:
            hazards.append(text)
    return hazards
