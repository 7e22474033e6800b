"""The fused DeltaNet decode kernel compiled for the H200 (sm_90) on the CPU, checked for what
neither the interpreter nor a lucky GPU run shows: a program overwriting memory it loaded
through a layout that holds an element in several threads, with no barrier in between
(`tests/triton_hazards.py`). The first GPU run of the kernel failed that way: each program's v
window moved while some of its warps had still to read it."""

from __future__ import annotations

import pytest

from tests.triton_hazards import compile_ttgir, in_place_hazards

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
pytest.importorskip("triton.backends.nvidia")


@triton.jit
def _shift_in_place(x_ptr, n: tl.constexpr):
    cols = tl.arange(0, n)
    x = tl.load(x_ptr + cols)
    tl.store(x_ptr + cols, x + 1.0)


def test_hazard_check_sees_an_unfenced_overwrite():
    """A vector of 32 held by 4 warps and stored back in place is a hazard; 128 elements, one
    per thread, is not."""
    small = compile_ttgir(_shift_in_place, {"x_ptr": "*fp32"}, {"n": 32}, num_warps=4)
    assert len(in_place_hazards(small)) == 1
    whole = compile_ttgir(_shift_in_place, {"x_ptr": "*fp32"}, {"n": 128}, num_warps=4)
    assert in_place_hazards(whole) == []


@pytest.mark.parametrize(
    ("key_heads", "value_heads", "dim", "dtype", "num_warps"),
    [(16, 32, 128, "bf16", 4), (16, 32, 128, "bf16", 8), (2, 4, 64, "fp32", 2)],
)
def test_decode_kernel_overwrites_nothing_unfenced(key_heads, value_heads, dim, dtype, num_warps):
    from pegainfer.models.qwen35.kernels import DECODE_BLOCK, _decode_kernel

    pointers = {"conv_state_ptr": "*fp32", "state_ptr": "*fp32", "slots_ptr": "*i32",
                "arrivals_ptr": "*i32"}  # fmt: skip
    signature = {name: pointers.get(name, f"*{dtype}") for name in _decode_kernel.arg_names
                 if name.endswith("_ptr")}  # fmt: skip
    signature |= {name: "fp32" for name in ("scale", "eps")}
    constants = {"NUM_KEY_HEADS": key_heads, "GROUP": value_heads // key_heads, "DK": dim,
                 "DV": dim, "BV": min(dim, DECODE_BLOCK)}  # fmt: skip
    for name in _decode_kernel.arg_names:
        signature.setdefault(name, "i32")
    ttgir = compile_ttgir(_decode_kernel, signature, constants, num_warps)
    assert in_place_hazards(ttgir) == []
