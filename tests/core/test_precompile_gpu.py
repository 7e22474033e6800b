"""The kernels an engine's steps launch were compiled while its weights loaded (issue 21): each
Triton specialization the start (KV sizing, graph capture, warm-up) and a mixed load make is one
its line's kernel plan listed, so none waits on the compiler on a fresh machine; and the plan's
compiles land in Triton's disk cache. One small model per line family at its real head
geometry (CUDA; skipped elsewhere)."""

from __future__ import annotations

import random

import pytest

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.kernels.precompile import KernelLaunch
from tests.core.test_warmup_gpu import WRITERS, serve

pytestmark = pytest.mark.gpu


class MadeKeys:
    """Records the cache key of each Triton specialization this process makes."""

    def __init__(self) -> None:
        self.made: dict[str, str] = {}  # key -> kernel name

    def __call__(self, **kwargs) -> bool:
        self.made[kwargs["key"]] = getattr(kwargs.get("fn"), "name", "?")
        return False  # go on and make it

    def __enter__(self) -> MadeKeys:
        from triton import knobs

        self._before = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self
        return self

    def __exit__(self, *exc: object) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook = self._before


def triton_key(launch: KernelLaunch) -> str:
    """The key Triton's launch of `launch` looks its in-memory cache up by (`JITFunction.run`:
    the binder's specialization and options; newer Tritons through `compute_cache_key`)."""
    from triton import knobs
    from triton.runtime import jit
    from triton.runtime.driver import driver

    kernel = launch.kernel()
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    binder = kernel.device_caches[driver.active.get_current_device()][-1]
    _, specialization, options = binder(*launch.args, **kwargs)
    if hasattr(jit, "compute_cache_key"):
        return jit.compute_cache_key({}, specialization, options)
    return str(specialization) + str(options)


@pytest.mark.parametrize("line", sorted(WRITERS))  # a line not installed skips
def test_steps_launch_only_what_the_kernel_plan_compiled(line, tmp_path, monkeypatch):
    cache = tmp_path / "triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))  # empty: the plan's compiles land here
    model = tmp_path / "model"
    WRITERS[line](model)
    args = EngineArgs(model=str(model), device="cuda", dtype="bfloat16", max_model_len=1024,
                      max_num_seqs=8, max_num_batched_tokens=256,
                      gpu_memory_utilization=0.3)  # fmt: skip
    with MadeKeys() as made:
        engine = EngineCore(args)
        serve(engine, random.Random(0), num_requests=24, max_len=600)
    launches = engine.precompile.launches
    assert launches, f"the {line} line's kernel plan lists no Triton launch"
    planned = {triton_key(launch) for launch in launches}
    missed = sorted(f"{name}: {key}" for key, name in made.made.items() if key not in planned)
    assert not missed, "launched but not in the kernel plan:\n" + "\n".join(missed)
    # Every planned kernel was compiled into the (fresh) disk cache by the pool's processes.
    compiled = {path.stem for path in cache.rglob("*.cubin")}
    names = {launch.name for launch in launches}
    assert names <= compiled, f"not in Triton's cache: {sorted(names - compiled)}"
    engine.shutdown()
