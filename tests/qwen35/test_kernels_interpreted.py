"""The fused DeltaNet decode kernel's logic on the CPU, through Triton's interpreter
(TRITON_INTERPRET=1, in a process of its own: the interpreter is chosen when a kernel is
defined), in float32 at small widths, against the reference ops: key heads shared by two or
three value heads and one each, heads of one value block and of several, programs of part of
a head and of a whole one, two steps (so the arrival counters must have been reset). The
interpreter runs one program at a time, as a whole, so this checks what the kernel computes,
not how its programs or their threads race: `test_kernels_compiled.py` checks its compiled
form for overwrites a barrier must fence, `test_kernels_gpu.py` runs these cases on a GPU."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.triton_interpreter import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import json
    import torch
    from pegainfer.models.qwen35.kernels import DecodeLaunch
    from tests.qwen35.deltanet_cases import decode_errors

    # (sequences, key heads, value heads, dim, value block): blocks of part of a head, whose
    # last program normalises, and of a whole head (shared q/k windows, and a group of one).
    cases = [(1, 2, 4, 16, 8), (3, 2, 4, 64, 16), (3, 2, 2, 16, 8), (2, 1, 3, 16, 8),
             (2, 1, 3, 8, 8), (2, 2, 4, 16, 16), (2, 2, 2, 16, 16)]
    print(json.dumps([decode_errors(*case[:4], torch.float32, "cpu", launch=DecodeLaunch(case[4]))
                      for case in cases]))
""")


def test_decode_kernel_interpreted():
    for errors in json.loads(run_interpreted(SCRIPT).strip().splitlines()[-1]):
        assert errors["out"] < 2e-5 and errors["conv"] < 1e-6 and errors["state"] < 1e-5, errors
        assert errors["arrivals"] == 0, errors
