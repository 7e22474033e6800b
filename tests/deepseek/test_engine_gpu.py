"""DeepSeek-V2 on CUDA (bf16: FlashInfer's MLA in the absorbed form, the Triton MoE, decode
CUDA graphs) against transformers in bf16, at the golden gate's tolerances.

V2-Lite's attention geometry (latent 512, rope key 64, nope 128, value 128, its YaRN) and its
MoE structure (a dense first layer, top-k routed experts plus a shared one) at a small width."""

from __future__ import annotations

import json

import pytest
import torch

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine import EngineCore
from pegainfer.core.forward_batch import ForwardBatch
from tests.deepseek.hf_reference import write_hf_checkpoint
from tests.qwen3.golden_gate import (
    Case,
    TeacherForcer,
    judge,
    make_cases,
    reference_logprobs,
    small_gate_passes,
)

pytestmark = pytest.mark.gpu

VOCAB = 1000
LITE_GEOMETRY = {"vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 384,
                 "moe_intermediate_size": 128, "num_hidden_layers": 3,
                 "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 512,
                 "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                 "n_routed_experts": 8, "num_experts_per_tok": 2,
                 "max_position_embeddings": 163840,
                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                     "original_max_position_embeddings": 4096,
                                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                                     "mscale_all_dim": 0.707}}  # fmt: skip


def hf_model(path, dtype: torch.dtype):
    import transformers

    return transformers.DeepseekV2ForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = write_hf_checkpoint(tmp_path_factory.mktemp("deepseek-gpu"), seed=3, **LITE_GEOMETRY)
    engine = EngineCore(EngineArgs(model=str(path), device="cuda", dtype="bfloat16",
                                   max_model_len=4096, max_num_seqs=16,
                                   gpu_memory_utilization=0.5))  # fmt: skip
    return path, engine


def test_the_engine_runs_flashinfer_mla_and_decode_graphs(small):
    from pegainfer.core.latent_attention import FlashInferPagedLatentAttention

    _, engine = small
    assert isinstance(engine.model.attn, FlashInferPagedLatentAttention)
    assert engine.graphs is not None and 16 in engine.graphs.buckets


def test_graph_replay_equals_eager_for_the_same_batch(small):
    _, engine = small
    forcer, bs, cuda = TeacherForcer(engine), engine.config.block_size, torch.device("cuda")
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40, 1, 33)]
    tables = [engine.block_manager.allocate(-(-(len(p) + 1) // bs)) for p in prompts]
    forcer._step(prompts, [0] * 5, tables, graphs=False)
    batch = ForwardBatch.build([[7]] * 5, [len(p) for p in prompts], tables, [True] * 5, bs, cuda)
    assert engine.graphs.can_run(batch)
    replayed = engine.graphs.run(batch).clone()
    padded = engine.graphs._padded(8, batch.seq_lens_cpu, batch.block_tables_cpu, [])
    for row, values in enumerate((batch.input_ids, batch.positions, batch.slot_mapping)):
        engine.graphs._inputs[row, :5].copy_(values)
    with torch.inference_mode():
        engine.model.prepare_graph(padded, 8)
        eager = engine.model(padded, engine.kv_cache)[:5]
    assert torch.equal(replayed, eager)
    for table in tables:
        engine.block_manager.release(table)


def test_small_golden_gate(small):
    """Nine cases batched in the 16-graph, five in the 8-graph, after a prefix hit and eagerly,
    plus a 1,500-token prompt (chunked prefill in the absorbed form)."""
    path, engine = small
    cases = make_cases(9, vocab=VOCAB, max_prompt=200, decode=8, seed=0)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (1508,), generator=g).tolist()
    long = Case(tokens[:1500], tokens[1500:])
    refs = {}
    for dtype in (torch.bfloat16, torch.float32):
        hf = hf_model(path, dtype)
        refs[dtype] = [reference_logprobs(hf, c) for c in [*cases, long]]
        del hf
    forcer = TeacherForcer(engine)
    passes = small_gate_passes(forcer, cases)
    long_pass = {"prompt_1500": forcer.run([long])}
    r16, r32 = refs[torch.bfloat16], refs[torch.float32]
    print(json.dumps(judge(long_pass, r16[-1:], r32[-1:], check=False), indent=2))
    print(json.dumps(judge(passes, r16[:-1], r32[:-1]), indent=2))
    judge(long_pass, r16[-1:], r32[-1:])
