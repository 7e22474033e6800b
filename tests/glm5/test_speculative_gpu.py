"""Speculative decoding of GLM-5 on CUDA with its MTP layer (bf16, GLM-5's attention geometry:
the layer's latents, rope keys and indexer keys written by the Triton kernels, attention
through FlashInfer's MLA, dense and over the indexer's selections past index_topk): greedy
output follows plain decoding's (whose decodes replay CUDA graphs, while verify steps run
eagerly: rounding may part them late at a near tie), and an MTP layer made to echo the
target's own prediction drafts exactly the token each request just took, at every step."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.speculative.mtp import MTPDrafter
from pegainfer.models.glm5.line import Glm5Line
from tests.engine_harness import generate, greedy, submit
from tests.speculative_harness import OracleDrafter

pytestmark = pytest.mark.gpu
NEW_TOKENS = 32
PROMPT_VOCAB = 250  # prompt ids are drawn below this (the tiny tokenizer's vocabulary)
# GLM-5's attention geometry (FlashInfer's MLA: latent 512, rope 64) at a small width, index_topk
# below most prompts.
SMALL = {"hidden_size": 256, "intermediate_size": 384, "moe_intermediate_size": 128,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
         "q_lora_rank": 256, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
         "qk_rope_head_dim": 64, "v_head_dim": 256, "index_n_heads": 32, "index_head_dim": 128,
         "index_topk": 32, "first_k_dense_replace": 2, "torch_dtype": "bfloat16"}  # fmt: skip


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("glm5-speculative-gpu")
    Glm5Line().write_tiny_checkpoint(path, seed=6, **SMALL)
    return path


@pytest.fixture(scope="module")
def echo_path(path, tmp_path_factory) -> Path:
    """The same checkpoint, its MTP layer made to echo: `eh_proj` passes the hidden state
    through and drops the embedding, the decoder layer adds nothing (its output projections
    zero), both norms before the LM head are ones and the head is the target's. Each draft is
    then the argmax of the target's logits at the row it continues from, scaled."""
    echo = tmp_path_factory.mktemp("glm5-speculative-gpu-echo")
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):  # fmt: skip
        (echo / name).write_bytes((path / name).read_bytes())
    tensors = load_file(path / "model.safetensors")
    layer = f"model.layers.{SMALL['num_hidden_layers']}."
    h = SMALL["hidden_size"]
    for name, tensor in tensors.items():
        if name.startswith(layer) and name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    tensors[layer + "eh_proj.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1).to(
        tensors[layer + "eh_proj.weight"].dtype
    )
    for norm in ("hnorm.weight", "shared_head.norm.weight"):
        tensors[layer + norm] = torch.ones_like(tensors[layer + norm])
    tensors[layer + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, echo / "model.safetensors", metadata={"format": "pt"})
    return echo


def engine_for(path: Path, **overrides) -> EngineCore:
    return EngineCore(EngineArgs(model=str(path), device="cuda", dtype="bfloat16",
                                 max_model_len=512, max_num_seqs=8, num_kv_blocks=256,
                                 **overrides))  # fmt: skip


def release(engine: EngineCore) -> None:
    engine.block_manager.check_invariants()
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def batch_of(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, PROMPT_VOCAB, (n,), generator=g).tolist()
            for n in (3, 17, 64, 130, 9, 40)]  # fmt: skip


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


@pytest.mark.parametrize("oracle", [False, True], ids=["mtp", "oracle"])
def test_greedy_output_follows_plain_decoding(path, oracle):
    batch = batch_of(2)
    engine = engine_for(path)
    plain = generate(engine, batch, greedy(NEW_TOKENS))
    release(engine)
    engine = engine_for(path, speculative_tokens=3)
    assert isinstance(engine.speculative.drafter, MTPDrafter)
    assert {"mtp_ckv", "mtp_kpe", "mtp_index_k"} <= set(engine.kv_cache.arenas)
    if oracle:
        sequences = {str(i): p + o for i, (p, o) in enumerate(zip(batch, plain, strict=True))}
        engine.speculative.drafter = OracleDrafter(3, sequences, vocab=PROMPT_VOCAB)
    speculative = generate(engine, batch, greedy(NEW_TOKENS))
    assert engine.speculative.counters.num_draft_tokens > 0
    release(engine)
    agree = [common_prefix(s, p) for s, p in zip(speculative, plain, strict=True)]
    assert sum(agree) >= 0.75 * NEW_TOKENS * len(batch), agree
    assert min(agree) >= 4, agree


def test_echoing_mtp_layer_drafts_the_token_just_taken(echo_path):
    """Greedy requests: the target's argmax at the row before a request's newest token is
    that token, so every draft equals it, after prefill chunks and verify steps alike (the
    first draft reads the target's final hidden state of the right row; the later ones the
    layer's own output). The echo rescales the hidden state, which bf16 rounds: a near tie
    of the target's logits may go the other way, rarely; a wrong row would almost never
    agree."""
    k = 3
    engine = engine_for(echo_path, speculative_tokens=k, max_num_batched_tokens=64)
    for i, prompt in enumerate(batch_of(3)):
        submit(engine, str(i), prompt, greedy(12))
    drafts = agreeing = 0
    while engine.has_unfinished_requests:
        engine.step()
        for request in engine.requests.values():
            if request.draft_token_ids:
                drafts += k
                agreeing += request.draft_token_ids.count(request.token_ids[-1])
    assert drafts >= 60
    assert agreeing >= 0.9 * drafts, (agreeing, drafts)
    release(engine)
