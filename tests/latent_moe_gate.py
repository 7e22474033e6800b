"""Golden gates of the latent-attention MoE lines (DeepSeek-V2, Kimi-K2, GLM-5): random
weights written by transformers with the gates' recipe for peaked distributions, and the two
gates every line runs on them (small width; real widths at reduced depth)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from tests.qwen3.golden_gate import (
    Case,
    TeacherForcer,
    judge,
    judge_with_long_prompt,
    make_cases,
    real_shape_gate_passes,
    reference_logprobs,
    small_gate_passes,
)

FINAL_NORM_GAIN = 0.3


def write_gate_checkpoint(
    path: Path, config: dict, layer_out: float, seed: int = 0, model: str = "DeepseekV2"
) -> None:
    """A random transformers `{model}ForCausalLM` (bf16) with the Qwen gates' recipe for peaked
    distributions (`tests.qwen3.golden_gate.write_gate_checkpoint`): MLP and expert gate/up
    halved, embedding std 1/sqrt(hidden), layer outputs (o, dense/shared/expert down) scaled by
    `layer_out`, and an LM head equal to the embedding (its own parameter, as these models
    untie them), so each token's own logit stands above the bulk; the final norm's gain at 0.3
    keeps that logit near 14, where a bf16 step is 1/16 nat. Norms 1 + N(0, 0.1), a router
    spread enough that tokens pick different experts; a noaux_tc router's correction bias and
    GLM-5's indexer key-norm bias N(0, 0.1) (transformers starts them at 0)."""
    import transformers

    config_class = getattr(transformers, f"{model}Config")
    cfg = config_class(**config, initializer_range=0.02, dtype="bfloat16", bos_token_id=None,
                       eos_token_id=None)  # fmt: skip
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # billions of parameters: never in float32 at once
    try:
        with torch.device("cuda"):
            hf = getattr(transformers, f"{model}ForCausalLM")(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    hidden = cfg.hidden_size
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name == "model.norm.weight":
                param.copy_(FINAL_NORM_GAIN * (1 + 0.1 * torch.randn_like(param)))
            elif name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif name.endswith("k_norm.bias"):
                param.normal_(0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0, 2 * hidden**-0.5)
            elif name.endswith(("gate_proj.weight", "up_proj.weight", "experts.gate_up_proj")):
                param.mul_(0.5)
            elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                param.mul_(layer_out)
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.1)
        hf.model.embed_tokens.weight.normal_(0, hidden**-0.5)
        hf.lm_head.weight.copy_(hf.model.embed_tokens.weight)
    hf.save_pretrained(path)


def hf_references(
    path: Path, cases: list[Case], model: str
) -> dict[torch.dtype, list[torch.Tensor]]:
    """transformers' (`{model}ForCausalLM`) logprobs for each case, in bf16 and in float32
    (one model at a time)."""
    import transformers

    refs = {}
    for dtype in (torch.bfloat16, torch.float32):
        model_class = getattr(transformers, f"{model}ForCausalLM")
        hf = model_class.from_pretrained(path, dtype=dtype).cuda().eval()
        refs[dtype] = [reference_logprobs(hf, c) for c in cases]
        del hf
        torch.cuda.empty_cache()
    return refs


def run_small_gate(path: Path, engine: EngineCore, model: str, vocab: int) -> None:
    """Nine cases of up to 200 tokens batched in the 16-graph, five in the 8-graph, after a
    prefix hit and eagerly, plus a 1,500-token prompt (one prefill from position 0), against
    transformers' `{model}ForCausalLM` in bf16 and float32."""
    cases = make_cases(9, vocab=vocab, max_prompt=200, decode=8, seed=0)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab, (1508,), generator=g).tolist()
    long = Case(tokens[:1500], tokens[1500:])
    refs = hf_references(path, [*cases, long], model)
    forcer = TeacherForcer(engine)
    passes = small_gate_passes(forcer, cases)
    long_pass = {"prompt_1500": forcer.run([long])}
    r16, r32 = refs[torch.bfloat16], refs[torch.float32]
    print(json.dumps(judge(long_pass, r16[-1:], r32[-1:], check=False), indent=2))
    print(json.dumps(judge(passes, r16[:-1], r32[:-1]), indent=2))
    judge(long_pass, r16[-1:], r32[-1:])


def run_real_width_gate(
    path: Path, model: str, vocab: int, num_cases: int, long_prompt: int, max_model_len: int
) -> None:
    """Batch 1 (twice, bit-identical), batch 9 in the 16-graph, a prefix hit, and one
    `long_prompt`-token prompt, against transformers' `{model}ForCausalLM` in bf16 and float32;
    the judgement is written to GATE_JSON when set."""
    cases = make_cases(num_cases, vocab=vocab, max_prompt=256, decode=10, seed=0)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (long_prompt + 10,), generator=g).tolist()
    long = Case(tokens[:long_prompt], tokens[long_prompt:])
    refs = hf_references(path, [*cases, long], model)
    engine = EngineCore(EngineArgs(model=str(path), device="cuda", dtype="bfloat16",
                                   max_model_len=max_model_len, max_num_seqs=16,
                                   gpu_memory_utilization=0.6))  # fmt: skip
    forcer = TeacherForcer(engine)
    passes = real_shape_gate_passes(forcer, cases)
    long_pass = {f"prompt_{long_prompt}": forcer.run([long])}
    out = Path(os.environ["GATE_JSON"]) if os.environ.get("GATE_JSON") else None
    judge_with_long_prompt(passes, long_pass, refs[torch.bfloat16], refs[torch.float32], out)
