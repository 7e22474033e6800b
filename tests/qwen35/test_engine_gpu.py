"""Qwen3.5 on CUDA (bf16, FlashInfer for the head_dim-64 full layers, reference DeltaNet ops)
against transformers in bf16, at the golden gate's tolerances."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.model_files import read_config
from pegainfer.core.model_line import ModelContext, RuntimeConfig
from pegainfer.models.qwen35.line import Qwen35Line
from tests.paged_runner import BLOCK, PagedRunner
from tests.qwen3.golden_gate import GateResult

pytestmark = pytest.mark.gpu


def test_prefill_chunks_and_decode_match_transformers_bf16(tmp_path):
    import transformers

    Qwen35Line().write_tiny_checkpoint(tmp_path, seed=2, dtype="bfloat16")
    cuda = torch.device("cuda")
    ctx = ModelContext(tmp_path, read_config(tmp_path), torch.bfloat16, cuda)
    model = Qwen35Line().build_model(ctx)
    model.init_runtime(RuntimeConfig(block_size=BLOCK, max_model_len=512))
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    hf = hf.cuda().eval()
    tokens = torch.randint(0, 500, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        reference = hf(torch.tensor([tokens], device=cuda)).logits[0].float().log_softmax(-1)
    runner, start, ours = PagedRunner(model, num_blocks=64, device="cuda"), 0, []
    for size in (70, 1, 66, 1, 1, 11):  # chunked prefill, then decodes
        ours.append(runner.step({"a": tokens[start : start + size]})["a"])
        start += size
    gate = GateResult()
    gate.add(torch.cat(ours), reference[:start])
    gate.check("qwen35 bf16 on cuda")
