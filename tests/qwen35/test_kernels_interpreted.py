"""The DeltaNet decode path's logic on the CPU, through Triton's interpreter (TRITON_INTERPRET=1,
in a process of its own: the interpreter is chosen when a kernel is defined), in float32 at
small widths: the fused decode kernel against the reference ops (key heads shared by two or
three value heads, and one each; with and without a rows remap; two steps, so the arrival
counters must have been reset), and the gated norm on the chunked rows of a mixed step.
The interpreter runs one program at a time, so this checks what the kernels compute, not how
their programs race: `test_kernels_gpu.py` runs the same cases compiled."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.triton_interpreter import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import json
    import torch
    from tests.qwen35.deltanet_cases import decode_errors, norm_errors

    cases = [(1, 2, 4, 16, False), (3, 2, 4, 16, True), (3, 2, 2, 16, False), (2, 1, 3, 8, True)]
    decode = [decode_errors(*case[:4], torch.float32, "cpu", case[4]) for case in cases]
    norm = norm_errors([3, 1, 70, 1, 2], 4, 16, torch.float32, "cpu")
    print(json.dumps({"decode": decode, "norm": norm}))
""")


def test_decode_kernel_and_chunk_norm_interpreted():
    result = json.loads(run_interpreted(SCRIPT).strip().splitlines()[-1])
    for errors in result["decode"]:
        assert errors["out"] < 2e-5 and errors["conv"] < 1e-6 and errors["state"] < 1e-5, errors
        assert errors["untouched"] == 0 and errors["arrivals"] == 0, errors
    assert result["norm"]["out"] < 1e-6 and result["norm"]["changed"] == 0, result["norm"]
