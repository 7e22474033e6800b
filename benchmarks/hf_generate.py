"""The naive baseline: transformers' `generate` at batch 1 on the same checkpoint and GPU.

    python benchmarks/hf_generate.py --model-path DIR --input-len 1024 --output-len 128 \\
        --out hf_generate.json

A random prompt of exactly --input-len token ids, greedy, exactly --output-len new tokens
(EOS ignored), bf16, transformers' default attention and cache. Reports the prefill (time to
the first token: a `generate` of one token) and the time per later token, medians of --runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers


def timed_generate(model, prompt: torch.Tensor, new_tokens: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(
        prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
    )
    torch.cuda.synchronize()
    assert out.shape[1] == prompt.shape[1] + new_tokens
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", required=True)
    parser.add_argument("--revision", default=None)
    args = parser.parse_args()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model_path, dtype=torch.bfloat16
    ).cuda()
    model.eval()
    eos = model.generation_config.eos_token_id
    model.generation_config.pad_token_id = eos[0] if isinstance(eos, list) else eos
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.input_len), generator=g).cuda()
    with torch.inference_mode():
        timed_generate(model, prompt, 4)  # warm-up
        first = [timed_generate(model, prompt, 1) for _ in range(args.runs)]
        total = [timed_generate(model, prompt, args.output_len) for _ in range(args.runs)]
    ttft = statistics.median(first)
    tpot = (statistics.median(total) - ttft) / (args.output_len - 1)
    result = {
        "engine": f"transformers {transformers.__version__} generate, batch 1",
        "revision": args.revision, "device": torch.cuda.get_device_name(),
        "model_path": args.model_path, "input_len": args.input_len,
        "output_len": args.output_len, "ttft_ms": ttft * 1e3, "tpot_ms": tpot * 1e3,
        "output_tokens_per_s": 1 / tpot,
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
