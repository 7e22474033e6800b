"""Qwen3, Qwen3.5, DeepSeek-V2 and GLM-5 split over two gloo ranks (heads, KV heads, DeltaNet
heads, MLP width and vocabulary halved, each routed expert's width halved or, expert parallel,
the routed experts divided, weights sliced from the checkpoint at load; GLM-5's indexer whole
on each rank; Qwen3 from an FP8 block-quantized checkpoint, its weights and scales sliced on
block boundaries) compute the single-process logits (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pegainfer.core.distributed.parallel import ParallelGroup
from pegainfer.core.errors import ConfigError
from pegainfer.core.loading.model_files import read_config
from pegainfer.core.model import ModelContext
from pegainfer.core.model_line import ModelLine, RuntimeConfig
from pegainfer.models.qwen3.line import Qwen3Line
from tests.core.test_parallel import free_port
from tests.paged_runner import PagedRunner, random_tokens
from tests.qwen3.hf_reference import VOCAB, write_hf_checkpoint

# "deepseek-ep": the routed experts divided between the ranks rather than split in width.
LINES = ("deepseek", "deepseek-ep", "glm5", "glm5-ep", "qwen3", "qwen3-fp8", "qwen35")


def line_class(line: str) -> type[ModelLine]:
    """Imported on use: a line that is not installed skips its cases (tests/conftest.py)."""
    if line == "qwen35":
        from pegainfer.models.qwen35.line import Qwen35Line

        return Qwen35Line
    if line.startswith("deepseek"):
        from pegainfer.models.deepseek.line import DeepseekLine

        return DeepseekLine
    if line.startswith("glm5"):
        from pegainfer.models.glm5.line import Glm5Line

        return Glm5Line
    return Qwen3Line


def steps(line: str, path: Path, group: ParallelGroup) -> list[torch.Tensor]:
    """A prefill, two decodes beside a second prompt's chunks: every step's logits."""
    ctx = ModelContext(path, read_config(path), torch.float32, torch.device("cpu"), group,
                       expert_parallel=line.endswith("-ep"))  # fmt: skip
    model = line_class(line)().build_model(ctx)
    model.init_runtime(
        RuntimeConfig(block_size=4, max_model_len=256, max_num_batched_tokens=256, max_num_seqs=16)
    )
    a, b = random_tokens(19, 1, VOCAB), random_tokens(12, 2, VOCAB)
    runner = PagedRunner(model)
    logits = [runner.step({"a": a[:17]})["a"]]
    logits.append(torch.cat(list(runner.step({"a": a[17:18], "b": b[:7]}).values())))
    logits.append(torch.cat(list(runner.step({"a": a[18:19], "b": b[7:]}).values())))
    return logits


def _worker(rank: int, world: int, port: int, line: str, path: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        logits = steps(line, Path(path), ParallelGroup(rank, world, dist.group.WORLD))
        torch.save(logits, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def write(line: str, path: Path, tie: bool) -> Path:
    if line.startswith("deepseek"):
        from tests.deepseek.hf_reference import write_hf_checkpoint as write_deepseek_checkpoint

        return write_deepseek_checkpoint(path, tie_word_embeddings=tie)
    if line.startswith("glm5"):
        from tests.glm5.hf_reference import write_hf_checkpoint as write_glm5_checkpoint

        return write_glm5_checkpoint(path, tie_word_embeddings=tie)
    if line == "qwen35":
        from tests.qwen35.hf_reference import write_hf_checkpoint as write_qwen35_checkpoint

        return write_qwen35_checkpoint(path, tie=tie)
    if line == "qwen3-fp8":
        from tests.quant_checkpoints import FP8_BLOCK_CONFIG, quantize_checkpoint

        source = write_hf_checkpoint(path.with_name("bf16"), tie=tie)
        config = FP8_BLOCK_CONFIG | {"weight_block_size": [32, 32]}
        quantize_checkpoint(source, path, config, lambda m: m.endswith("_proj"))
        return path
    return write_hf_checkpoint(path, tie=tie)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("line", LINES)
def test_two_ranks_equal_one(tmp_path, line, tie):
    path = write(line, tmp_path / "ckpt", tie)
    expected = steps(line, path, ParallelGroup())
    args = (2, free_port(), line, str(path), str(tmp_path))
    mp.spawn(_worker, args=args, nprocs=2, join=True)
    for rank in range(2):
        for got, want in zip(torch.load(tmp_path / f"rank{rank}.pt"), expected, strict=True):
            assert (got - want).abs().max().item() <= 1e-4


def test_a_shape_that_does_not_split_is_refused(tmp_path):
    path = write_hf_checkpoint(tmp_path, tie=True)
    ctx = ModelContext(path, read_config(path), torch.float32, torch.device("cpu"),
                       ParallelGroup(0, 3))  # fmt: skip
    with pytest.raises(ConfigError, match="does not split over 3 ranks"):
        Qwen3Line().build_model(ctx)
