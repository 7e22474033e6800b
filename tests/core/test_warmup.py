"""The warm-up's steps (`runner.warmup`): which token counts and shapes it runs, that they fit
the engine's bounds, and that they leave nothing behind: a warmed engine generates what a
fresh one does (CPU; on CUDA the engine runs it at start, `test_warmup_gpu.py`)."""

from __future__ import annotations

import pytest

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.plugins import find_model_line
from pegainfer.core.runner.warmup import (
    WarmupShape,
    module_token_counts,
    warm_up,
    warmup_batches,
    warmup_token_counts,
)
from tests.engine_harness import generate, greedy

CPU = "cpu"


def test_token_counts_cross_every_power_of_two_and_sixteen():
    assert warmup_token_counts(2048, 40960) == [
        1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 256, 257, 512, 513, 1024, 1025,
        2048,
    ]  # fmt: skip
    assert warmup_token_counts(100, 40960)[-3:] == [64, 65, 100]
    assert warmup_token_counts(2048, 40)[-3:] == [32, 33, 40]  # no prompt past max_model_len
    assert warmup_token_counts(1, 10) == [1]
    assert warmup_token_counts(100, 4096, frozenset({7, 70, 700})) == [
        1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 32, 33, 64, 65, 70, 100,
    ]  # fmt: skip


@pytest.mark.parametrize("recurrent", [False, True])
def test_batches_stay_within_the_engines_bounds(recurrent):
    import torch

    shape = WarmupShape(block_size=16, max_num_batched_tokens=512, max_model_len=4096,
                        max_num_seqs=8, num_blocks=40, recurrent=recurrent,
                        num_checkpoints=2)  # fmt: skip
    batches = list(warmup_batches(shape, torch.device(CPU)))
    counts = warmup_token_counts(512, 4096)
    assert [b.num_tokens for b in batches[: len(counts)]] == counts
    mixed = batches[len(counts) : len(counts) + 2]
    assert [b.query_lens_cpu for b in mixed] == [[1, 17], [1, 1, 1, 17]]
    assert [b.seq_lens_cpu[-1] for b in mixed] == [16 + 3 + 17] * 2  # after a cached prefix
    assert len(batches) == len(counts) + 2 + recurrent
    if recurrent:
        assert batches[-1].state_restore_cpu == [8] and batches[-1].state_snapshot_cpu == [(5, 9)]
    for batch in batches:
        assert batch.num_tokens <= 512 and batch.num_seqs <= 8
        assert max(max(table) for table in batch.block_tables_cpu) < 40
        if recurrent:
            assert max(batch.state_slots_cpu) < 8
        else:
            assert batch.state_slots_cpu == []


def test_a_small_cache_skips_what_it_cannot_hold():
    import torch

    shape = WarmupShape(block_size=16, max_num_batched_tokens=2048, max_model_len=4096,
                        max_num_seqs=256, num_blocks=10)  # fmt: skip
    batches = list(warmup_batches(shape, torch.device(CPU)))
    assert max(b.num_tokens for b in batches) == 129  # 9 blocks; 257 tokens need 17
    assert all(max(max(t) for t in b.block_tables_cpu) < 10 for b in batches)


@pytest.mark.parametrize("line", ["qwen3", "qwen35", "deepseek"])
def test_a_warmed_engine_generates_what_a_fresh_one_does(line, tmp_path):
    find_model_line(line).write_tiny_checkpoint(tmp_path, seed=4)
    args = EngineArgs(model=str(tmp_path), device=CPU, max_model_len=256, max_num_seqs=4,
                      max_num_batched_tokens=64, block_size=8)  # fmt: skip
    prompts = [list(range(3, 40)), [5] * 9, list(range(100, 180))]
    fresh = generate(EngineCore(args), prompts, greedy(6))
    engine = EngineCore(args)
    recurrent = bool(engine.model.state_arenas())
    shape = WarmupShape(args.block_size, args.max_num_batched_tokens, args.max_model_len,
                        args.max_num_seqs, engine.config.num_kv_blocks, recurrent,
                        args.state_checkpoints if recurrent else 0)  # fmt: skip
    extra = module_token_counts(engine.model, shape)
    assert bool(extra) == (line == "deepseek")  # the fused MoE's counts
    steps = len(list(warmup_batches(shape, engine.runner.device, extra)))
    assert warm_up(engine.runner, shape) == steps
    assert generate(engine, prompts, greedy(6)) == fresh


@pytest.mark.line("deepseek")
def test_module_counts_leave_out_the_graph_buckets(tmp_path):
    find_model_line("deepseek").write_tiny_checkpoint(tmp_path, seed=2)
    engine = EngineCore(EngineArgs(model=str(tmp_path), device=CPU, max_model_len=256))
    shape = WarmupShape(16, 256, 256, 8, 100)
    counts = module_token_counts(engine.model, shape)
    assert counts and max(counts) <= 256 and 1 in counts
    assert module_token_counts(
        engine.model, WarmupShape(16, 256, 256, 8, 100, graph_buckets=(1, 2))
    ) == counts - {1, 2}


def test_a_specialization_made_while_serving_is_logged(monkeypatch, caplog):
    triton = pytest.importorskip("triton")
    from pegainfer.core.runner import warmup

    knobs = triton.knobs.runtime
    monkeypatch.setattr(knobs, "jit_cache_hook", None)
    warmup.watch_late_compiles()
    hook = knobs.jit_cache_hook
    assert hook is not None

    class Kernel:
        name = "_chunk_state_kernel"

    with caplog.at_level("WARNING", logger=warmup.__name__):
        assert hook(fn=Kernel(), repr="_chunk_state_kernel[BT=64]") is False  # still compiles
    assert "_chunk_state_kernel specialized while serving" in caplog.text
    assert "BT=64" in caplog.text


def test_a_hook_installed_by_someone_else_is_left_alone(monkeypatch):
    triton = pytest.importorskip("triton")
    from pegainfer.core.runner import warmup

    def theirs(**kwargs):
        return False

    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", theirs)
    warmup.watch_late_compiles()
    assert triton.knobs.runtime.jit_cache_hook is theirs
