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
    ("key_heads", "value_heads", "dim", "dtype", "block", "num_warps"),
    [
        (16, 32, 128, "bf16", 32, 4),  # Qwen3.5-4B at the default launch
        (16, 32, 128, "bf16", 16, 2),
        (16, 32, 128, "bf16", 128, 8),  # a whole head per program
        (2, 2, 64, "fp32", 8, 1),
    ],
)
def test_decode_kernel_overwrites_nothing_unfenced(
    key_heads, value_heads, dim, dtype, block, num_warps
):
    from pegainfer.models.qwen35.kernels import DeltaNetShape, _decode_kernel

    shape = DeltaNetShape(key_heads, value_heads, dim, dim)
    channels, width = shape.conv_channels, shape.conv_channels + value_heads * dim + 2 * value_heads
    args: dict[str, str | int] = {
        name: f"*{dtype}" for name in _decode_kernel.arg_names if name.endswith("_ptr")
    }
    args |= {"conv_state_ptr": "*fp32", "state_ptr": "*fp32", "slots_ptr": "*i32",
             "arrivals_ptr": "*i32", "scale": "fp32", "eps": "fp32"}  # fmt: skip
    args |= {"stride_proj": width, "z_col": channels, "a_col": width - value_heads,
             "b_col": width - 2 * value_heads, "stride_conv_slot": 3 * channels,
             "stride_state_slot": value_heads * dim * dim,
             "stride_out": value_heads * dim}  # fmt: skip
    group = value_heads // key_heads
    constants = {"NUM_KEY_HEADS": key_heads, "GROUP": group, "DK": dim, "DV": dim, "BV": block,
                 "GROUP_P2": 1 << (group - 1).bit_length()}  # fmt: skip
    ttgir = compile_ttgir(_decode_kernel, args, constants, num_warps)
    assert in_place_hazards(ttgir) == []
