"""Running Triton kernels on the CPU through Triton's interpreter: TRITON_INTERPRET=1 is read
when a kernel is defined, so a script runs in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys


def run_interpreted(script: str) -> str:
    """`script`'s stdout, after asserting it ran to the end."""
    env = os.environ | {"TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
