"""The kernel plans of issue 21 on the CPU: recording Triton launches from launchers run on meta
tensors, what tells two launches' compiles apart, each line's plan covering every kernel its
packages launch, and the background compile reporting (not raising) what failed."""

from __future__ import annotations

import ast
import importlib
import json
import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from pegainfer.core.kernels import plan_store
from pegainfer.core.kernels.precompile import (
    KernelLaunch,
    KernelPlan,
    Precompile,
    StepBounds,
    TensorArg,
    probe_batch,
    record_launches,
)
from pegainfer.core.model import ModelContext
from pegainfer.core.runner.meta_steps import meta_steps

META = torch.device("meta")
BOUNDS = StepBounds(block_size=16, max_num_batched_tokens=256, max_num_seqs=8)


def meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=META)


def test_launches_are_recorded_once_per_specialization_and_not_run():
    from pegainfer.core.kernels import activation, norm

    weight = meta(256)
    with record_launches() as launches:
        for tokens in (1, 7, 16, 33):  # the grid changes, not the kernel
            x = meta(tokens, 256)
            norm.add_rms_norm(x, None, weight, 1e-6)
            norm.add_rms_norm(x, meta(tokens, 256), weight, 1e-6)
            activation.silu_and_mul(meta(tokens, 512))
    names = sorted(launch.name for launch in launches)
    assert names == ["_add_rms_norm_kernel", "_add_rms_norm_kernel", "_silu_and_mul_kernel"]
    norms = [launch for launch in launches if launch.name == "_add_rms_norm_kernel"]
    assert {dict(launch.kwargs)["HAS_RESIDUAL"] for launch in norms} == {False, True}
    first = norms[0]
    assert first.module == "pegainfer.core.kernels.norm"
    assert first.args[0] == TensorArg(torch.bfloat16, 0)
    assert dict(first.kwargs)["BLOCK"] == 256 and first.args[4:8] == (256, 256, 256, 256)


def test_a_view_records_its_offset_and_the_kernel_decides_whether_it_counts():
    a = meta(4, dtype=torch.int64)
    assert TensorArg.of(a[1:]) == TensorArg(torch.int64, 8)
    assert TensorArg.of(a[2:]) == TensorArg(torch.int64, 0)

    def launch(module: str, name: str, args: list) -> KernelLaunch:
        return KernelLaunch(module, name, tuple(args), ())

    # Qwen3's q/k kernel reads positions as scalars (not specialized on alignment); its q/k/v
    # input is a tensor it is specialized on.
    module, name = "pegainfer.models.qwen3.kernels", "_qk_norm_rope_kv_kernel"
    tensors = [TensorArg(torch.bfloat16)] * 5 + [TensorArg(torch.int64)] * 2
    tensors += [TensorArg(torch.bfloat16)] * 2
    ints = [512, 256, 64, 4096, 2048, 128, 16, 1e-6]
    base = launch(module, name, tensors + ints)
    moved_positions = [*tensors[:5], TensorArg(torch.int64, 8), *tensors[6:]]
    assert launch(module, name, moved_positions + ints).key() == base.key()
    moved_input = [TensorArg(torch.bfloat16, 8), *tensors[1:]]
    assert launch(module, name, moved_input + ints).key() != base.key()
    # An int argument: equal to 1, divisible by 16 or neither, each compiles once.
    classes = {launch(module, name, [*tensors, 512, 256, 64, 4096, 2048, 128, n, 1e-6]).key()
               for n in (1, 16, 32, 17, 19)}  # fmt: skip
    assert len(classes) == 3


@pytest.mark.parametrize(("specialize", "align"), [(True, True), (True, False), (False, True)])
def test_the_plans_key_tells_apart_exactly_what_triton_compiles_apart(specialize, align):
    """A plan keeps one launch per key (`record_launches`): two arguments Triton specializes
    differently must not share a key (one would go uncompiled), nor two it treats alike differ
    (compiled twice). Checked against Triton's own specialization of each value."""
    from itertools import combinations

    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from pegainfer.core.kernels.precompile import _spec

    tensors = [TensorArg(dtype, offset) for dtype, offset in
               ((torch.bfloat16, 0), (torch.bfloat16, 8), (torch.int64, 0), (torch.int64, 8),
                (torch.float32, 4))]  # fmt: skip
    values = [0, 1, 2, 15, 16, 17, 48, 2**31 - 16, 2**31, 2**31 + 1, -16, -1, True, False, 0.5,
              1.0, None, *tensors]  # fmt: skip
    for a, b in combinations(values, 2):
        ours = _spec(a, False, specialize, align) == _spec(b, False, specialize, align)
        theirs = (native_specialize_impl(BaseBackend, a, False, specialize, align)
                  == native_specialize_impl(BaseBackend, b, False, specialize, align))  # fmt: skip
        assert ours == theirs, (a, b)


def test_meta_steps_cover_every_size_class_within_the_bounds():
    bounds = StepBounds(block_size=16, max_num_batched_tokens=64, max_num_seqs=8,
                        graph_buckets=(1, 2, 4, 8))  # fmt: skip
    steps = meta_steps(bounds, recurrent=True)
    prompts = sorted(
        s.num_tokens for s in steps if s.num_seqs == 1 and s.seq_lens_cpu[0] == s.num_tokens
    )
    assert prompts == bounds.token_counts() == [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64]
    decodes = sorted(s.num_seqs for s in steps if s.is_decode and s.num_seqs > 1)
    assert decodes == [2, 3, 4, 5, 8]
    assert all(s.input_ids.is_meta for s in steps)
    assert any(snapshot is not None for s in steps for snapshot in s.state_snapshot_cpu)


def launched_kernels(package: str) -> set[str]:
    """The Triton kernels a package's modules launch (`name[grid](...)` calls)."""
    root = Path(importlib.import_module(package).__file__).parent
    names = set()
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        jitted = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
                  and any("triton.jit" in ast.unparse(d) for d in node.decorator_list)}  # fmt: skip
        for node in ast.walk(tree):
            call = node.func if isinstance(node, ast.Call) else None
            if isinstance(call, ast.Subscript) and isinstance(call.value, ast.Name):
                names |= {call.value.id} & jitted
    return names


# The routed MoE's kernels with routing in one kernel (DeepSeek-V2-Lite's greedy softmax).
MOE = {"_route_kernel", "_dispatch_kernel", "_gate_up_kernel", "_down_kernel", "_combine_kernel"}
LINES = {
    # line: (its line class, tiny checkpoint overrides, the kernels its steps launch beyond
    # core's layer ops)
    "qwen3": ("pegainfer.models.qwen3.line:Qwen3Line", {},
              lambda: launched_kernels("pegainfer.models.qwen3")),
    "qwen35": ("pegainfer.models.qwen35.line:Qwen35Line", {},
               lambda: launched_kernels("pegainfer.models.qwen35")),
    # FlashInfer's MLA sizes (a latent of 512, a rope part of 64), as DeepSeek-V2's.
    "deepseek": ("pegainfer.models.deepseek.line:DeepseekLine",
                 {"kv_lora_rank": 512, "qk_rope_head_dim": 64},
                 lambda: MOE | {"_latent_input_kernel"}),
}  # fmt: skip


@pytest.mark.parametrize("line", sorted(LINES))  # a line not installed skips
def test_a_lines_plan_covers_every_kernel_its_steps_launch(line, tmp_path, monkeypatch):
    path, overrides, kernels = LINES[line]
    if line == "qwen35":  # its fused decode kernel is opt-in: plan the steps that run it
        monkeypatch.setenv("PEGAINFER_QWEN35_FUSED_DECODE", "1")
    module, cls = path.split(":")
    model_line = getattr(importlib.import_module(module), cls)()
    model_line.write_tiny_checkpoint(tmp_path, **overrides)
    config = json.loads((tmp_path / "config.json").read_text())
    ctx = ModelContext(tmp_path, config, torch.bfloat16, torch.device("cuda"))
    bounds = StepBounds(16, 256, 8, (1, 2, 4, 8))
    plan = model_line.kernel_plan(ctx, bounds)
    launches = plan.launches()
    planned = {launch.name for launch in launches}
    expected = {"_add_rms_norm_kernel", "_silu_and_mul_kernel"} | kernels()
    assert expected <= planned, f"not in the plan: {sorted(expected - planned)}"
    assert plan.attention is not None
    # Deterministic: the same plan twice (the engine's ranks and a restart agree).
    again = model_line.kernel_plan(ctx, bounds).launches()
    assert [launch.key() for launch in again] == [launch.key() for launch in launches]


def test_qwen3s_plan_with_the_small_batch_gemv_covers_its_launches(tmp_path):
    """--small-batch-gemv: the LM head's and the gated gate_up's GEMV are in the plan, and
    absent from it without the flag."""
    from pegainfer.models.qwen3.line import Qwen3Line

    line = Qwen3Line()
    line.write_tiny_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    ctx = ModelContext(tmp_path, config, torch.bfloat16, torch.device("cuda"))
    bounds = StepBounds(16, 256, 8, (1, 2, 4, 8), small_batch_gemv=True)
    gemvs = [launch for launch in line.kernel_plan(ctx, bounds).launches()
             if launch.name == "_gemv_kernel"]  # fmt: skip
    assert {dict(launch.kwargs)["GATED"] for launch in gemvs} == {False, True}
    # In the launch's order: Triton's in-memory key holds the options as their dict's text, so
    # a warm-up passing num_stages before num_warps would load a kernel no step looks up.
    options = [[k for k, _ in launch.kwargs if k.startswith("num_")] for launch in gemvs]
    assert options == [["num_warps", "num_stages"]] * len(gemvs)
    plain = line.kernel_plan(ctx, StepBounds(16, 256, 8, (1, 2, 4, 8))).launches()
    assert all(launch.name != "_gemv_kernel" for launch in plain)


class PlannedBackend:
    def __init__(self) -> None:
        self.planned: list[int] = []

    def plan(self, batch) -> None:
        self.planned.append(batch.num_tokens)


@pytest.mark.parametrize("block_size", [1, 2, 16])
def test_the_probe_batch_holds_its_tokens_in_blocks_of_its_own(block_size):
    batch = probe_batch(block_size, torch.device("cpu"), decodes=3)
    assert batch.query_lens_cpu == [1, 1, 1, 3] and batch.seq_lens_cpu == [2, 2, 2, 3]
    tables = batch.block_tables_cpu
    assert all(len(t) * block_size >= n for t, n in zip(tables, batch.seq_lens_cpu, strict=True))
    blocks = [block for table in tables for block in table]
    assert len(blocks) == len(set(blocks))


def test_the_attention_backend_is_planned_on_a_decode_beside_a_prompt():
    backend = PlannedBackend()
    precompile = Precompile.start(KernelPlan(None, lambda: backend), BOUNDS, torch.device("cpu"))
    summary = precompile.wait()
    # One decode row, then a step's most (8), each beside a 3-token prompt.
    assert backend.planned == [4, 11]
    assert "attention modules" in summary and "failed" not in summary


def test_the_attention_backend_is_built_after_the_engines_imports():
    """Built beside the engine's import of FlashInfer, a backend importing `flashinfer.mla`
    deadlocked on the import locks (Python raised `_DeadlockError` on a GPU)."""
    imported = threading.Event()
    imports = threading.Thread(target=lambda: (time.sleep(0.2), imported.set()))
    seen = []

    def backend() -> PlannedBackend:
        seen.append(imported.is_set())
        return PlannedBackend()

    imports.start()
    Precompile.start(KernelPlan(None, backend), BOUNDS, torch.device("cpu"), None, imports).wait()
    assert seen == [True]


def test_failures_are_logged_and_left_to_the_first_launch(caplog):
    """A CPU has no Triton driver: the spawned process's warm-up fails, as do an attention
    factory and a recording that raise; `wait` says so in the log and returns."""
    from pegainfer.core.kernels import norm  # noqa: F401 - the launch's module

    flags = (("BLOCK", 256), ("HAS_RESIDUAL", False), ("ZERO_CENTRED", False))
    args = (TensorArg(torch.bfloat16),) * 4 + (256, 256, 256, 256, 1e-6)
    launch = KernelLaunch("pegainfer.core.kernels.norm", "_add_rms_norm_kernel", args, flags)

    def broken():
        raise RuntimeError("no backend here")

    with caplog.at_level(logging.WARNING, logger="pegainfer.core.kernels.precompile"):
        summary = Precompile.start(KernelPlan(lambda: (launch,), broken), BOUNDS,
                                   torch.device("cpu")).wait()  # fmt: skip
        plan_failed = Precompile.start(KernelPlan(broken), BOUNDS, torch.device("cpu")).wait()
    assert "1 Triton launches compiled on 1 processes" in summary and "2 failed" in summary
    assert "pegainfer.core.kernels.norm._add_rms_norm_kernel" in caplog.text
    assert "no backend here" in caplog.text
    assert "1 failed" in plan_failed and "recording the Triton launches" in caplog.text


def test_a_plan_compiled_before_is_read_not_recorded_nor_compiled(tmp_path, monkeypatch, caplog):
    """A plan whose launches a previous start compiled into this Triton cache is read from
    beside it: nothing is recorded or compiled again. A failed compile stores nothing; other
    plan inputs name another entry."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    flags = (("BLOCK", 256), ("HAS_RESIDUAL", False), ("ZERO_CENTRED", False))
    args = (TensorArg(torch.bfloat16, 8),) + (TensorArg(torch.float32),) * 3
    launch = KernelLaunch("pegainfer.core.kernels.norm", "_add_rms_norm_kernel",
                          (*args, 256, 256, 256, 256, 1e-6), flags)  # fmt: skip
    cpu = torch.device("cpu")
    path = plan_store.plan_path("inputs", cpu)
    assert path.is_relative_to(tmp_path) and plan_store.plan_path("other", cpu) != path
    with caplog.at_level(logging.WARNING, logger="pegainfer.core.kernels.precompile"):
        Precompile.start(KernelPlan(lambda: (launch,)), BOUNDS, cpu, "inputs").wait()  # no driver
    assert not path.exists()
    plan_store.store(path, (launch,))
    assert plan_store.load(path) == (launch,)

    def record():
        raise AssertionError("a stored plan is not recorded again")

    summary = Precompile.start(KernelPlan(record), BOUNDS, cpu, "inputs").wait()
    assert "1 Triton launches already in Triton's cache" in summary
    assert "recording" not in caplog.text


def test_the_engine_plans_per_layout(tmp_path, monkeypatch):
    """The engine's start: one process records its launches (and fails to compile them here,
    without a GPU: logged); a rank of a parallel layout only builds its attention (its forward
    exchanges tensors with the other ranks); a line with nothing to compile starts nothing."""
    from pegainfer.core.args import EngineArgs
    from pegainfer.core.distributed.parallel import ParallelGroup
    from pegainfer.core.engine.core import _start_precompile
    from pegainfer.core.model_line import ModelLine
    from pegainfer.models.qwen3.line import Qwen3Line

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    line = Qwen3Line()
    line.write_tiny_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    args = EngineArgs(model=str(tmp_path), max_num_seqs=4, max_num_batched_tokens=64)
    alone = ModelContext(tmp_path, config, torch.bfloat16, torch.device("cuda"))
    precompile = _start_precompile(args, line, alone, None)
    assert "failed" in precompile.wait()
    assert {launch.name for launch in precompile.launches} >= {"_qk_norm_rope_kv_kernel"}
    ranked = ModelContext(tmp_path, config, torch.bfloat16, torch.device("cpu"),
                          parallel=ParallelGroup(0, 2))  # fmt: skip
    precompile = _start_precompile(args, line, ranked, None)
    assert "0 Triton launches" in precompile.wait() and precompile.launches == ()
    monkeypatch.setattr(Qwen3Line, "kernel_plan", ModelLine.kernel_plan)
    assert _start_precompile(args, line, alone, None) is None
