"""`--load-format dummy`'s weights (`core.loading.random_fill`): every tensor drawn from its own
name, every routed expert from its global id, so ranks that divide the experts hold what one
process holding all of them does, and such an engine generates what one process does."""

from __future__ import annotations

import json

import pytest
import torch

from pegainfer.core.distributed.parallel import ParallelGroup
from pegainfer.core.model import ModelContext
from pegainfer.server.bench import make_checkpoint as mc
from tests.engine_harness import drain, greedy, make_engine, submit

pytestmark = pytest.mark.line("kimi_k2")
# Kimi-K2's layouts at a small width (block-aligned for FP8, group-aligned for INT4).
SMALL = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
         "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 128,
         "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32,
         "vocab_size": 1024, "num_hidden_layers": 3, "n_routed_experts": 8,
         "num_experts_per_tok": 2, "torch_dtype": "float32"}  # fmt: skip


def drawn(path, data_parallel: ParallelGroup) -> dict[str, torch.Tensor]:
    from pegainfer.models.kimi_k2.line import KimiK2Line

    config = json.loads((path / "config.json").read_text())
    ctx = ModelContext(path, config, torch.float32, torch.device("cpu"), expert_parallel=True,
                       data_parallel=data_parallel, random_weights=True)  # fmt: skip
    return dict(KimiK2Line().build_model(ctx).named_parameters())


@pytest.mark.parametrize("shape", ["kimi-k2", "kimi-k2-fp8", "kimi-k2-int4"])
def test_ranks_that_divide_the_experts_hold_what_one_process_does(tmp_path, shape):
    mc.write_weights(shape, tmp_path, overrides=SMALL, weights=False)
    whole = drawn(tmp_path, ParallelGroup())
    for rank in range(2):
        mine = drawn(tmp_path, ParallelGroup(rank, 2))
        for name, param in mine.items():
            if ".mlp.experts." in name:  # this rank's half of the stacked bank
                half = whole[name].shape[0] // 2
                assert torch.equal(param, whole[name][rank * half : (rank + 1) * half]), name
            else:
                assert torch.equal(param, whole[name]), name
    # Tensors of one shape differ from layer to layer (each is drawn from its own name).
    first, second = (whole[f"layers.{i}.mlp.gate"] for i in (1, 2))
    assert not torch.equal(first, second)


def test_two_attention_ranks_with_drawn_weights_generate_what_one_process_does(tmp_path):
    """The CPU miniature of the full-size check (issue 24): the same drawn weights, experts
    divided between two data-parallel ranks, greedy tokens equal one process's."""
    mc.write_weights("kimi-k2-int4", tmp_path, overrides=SMALL, weights=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (5, 19, 33)]

    def run(**layout) -> dict[str, list[int]]:
        engine = make_engine(tmp_path, load_format="dummy", max_num_batched_tokens=24, **layout)
        try:
            for i, prompt in enumerate(prompts):
                submit(engine, str(i), prompt, greedy(8))
            return drain(engine)
        finally:
            engine.shutdown()

    expected = run()
    assert run(data_parallel_size=2, enable_expert_parallel=True) == expected
