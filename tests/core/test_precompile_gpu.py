"""The kernels an engine's steps launch were compiled while its weights loaded (issue 21): each
Triton specialization the start (KV sizing, graph capture, warm-up) and a mixed load make is one
its line's kernel plan listed, so none waits on the compiler on a fresh machine; and the plan's
compiles land in Triton's disk cache. One small model per line family at its real head
geometry (CUDA; skipped elsewhere)."""

from __future__ import annotations

import random

import pytest

from pegainfer.core.args import EngineArgs
from tests.core.test_warmup_gpu import WRITERS, TritonSpecializations, serve
from tests.engine_harness import closing_engine

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("line", sorted(WRITERS))  # a line not installed skips
def test_steps_launch_only_what_the_kernel_plan_compiled(line, tmp_path, monkeypatch):
    """Triton makes a specialization once per process: `Precompile` loads each planned one
    (`JITFunction.warmup`) before any step runs, so a step that launches a specialization the
    plan did not list is the only launch that makes one. Comparing Triton's own cache keys
    this way needs no copy of how Triton computes them (its options grew keys across
    versions)."""
    cache = tmp_path / "triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))  # empty: the plan's compiles land here
    model = tmp_path / "model"
    WRITERS[line](model)
    args = EngineArgs(model=str(model), device="cuda", dtype="bfloat16", max_model_len=1024,
                      max_num_seqs=8, max_num_batched_tokens=256,
                      gpu_memory_utilization=0.3)  # fmt: skip
    with TritonSpecializations() as made, closing_engine(args) as engine:
        serve(engine, random.Random(0), num_requests=24, max_len=600)
        launches = engine.precompile.launches
    assert launches, f"the {line} line's kernel plan lists no Triton launch"
    assert not made.made, "launched but not in the kernel plan:\n" + "\n".join(made.made)
    # Every planned kernel was compiled into the (fresh) disk cache by the pool's processes.
    compiled = {path.stem for path in cache.rglob("*.cubin")}
    names = {launch.name for launch in launches}
    assert names <= compiled, f"not in Triton's cache: {sorted(names - compiled)}"
