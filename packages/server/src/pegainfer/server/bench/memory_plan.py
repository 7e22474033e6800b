"""`pegainfer-bench memory-plan SHAPE`: one GPU's bytes of a latent-MoE shape under a parallel
layout, by weight group, and the KV cache each token costs it; on no GPU.

The model is built by its own line on the meta device (`--load-format dummy`'s path, where no
value is drawn), as rank 0 of the layout would build it, so every byte counted is one the
engine allocates: quantized layers as stored, FP8 `kv_b_proj` dequantized to bf16 after
loading, a router's float32 correction bias. Every rank of these layouts holds the same sizes.
`docs/full-size-8xh200.md` is written from this (its tables are checked against it by a test).
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pegainfer.server.bench.make_checkpoint import LATENT_MOE_SHAPES, write_weights
from pegainfer.server.bench.options import subcommand

BLOCK_SIZE = 16
# Weight groups, by the first pattern a parameter's name matches (module paths of core's
# latent-MoE decoder: `layers.N.self_attn...`, `layers.N.mlp...`).
GROUPS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (group, re.compile(pattern))
    for group, pattern in (
        ("embedding", r"^embed_tokens"),
        ("lm_head", r"^lm_head"),
        ("indexer", r"\.self_attn\.indexer\."),
        ("attention", r"\.self_attn\."),
        ("routed_experts", r"\.mlp\.experts\."),
        ("shared_experts", r"\.mlp\.shared_experts\."),
        ("router", r"\.mlp\.(gate|e_score_correction_bias)$"),
        ("dense_mlp", r"\.mlp\."),
        ("norms", r""),
    )
)


@dataclass(frozen=True)
class Layout:
    """How the GPUs divide the model: `data_parallel` attention ranks (each its own sequences
    and KV, every weight but the routed experts whole) or `tensor_parallel` ranks (each a share
    of the heads, MLP widths and vocabulary); `expert_parallel`: the routed experts divided
    between the ranks whole, not split in width."""

    data_parallel: int = 1
    tensor_parallel: int = 1
    expert_parallel: bool = True

    @property
    def gpus(self) -> int:
        return self.data_parallel * self.tensor_parallel

    def describe(self) -> str:
        parts = [f"DP{self.data_parallel}"] if self.data_parallel > 1 else []
        parts += [f"TP{self.tensor_parallel}"] if self.tensor_parallel > 1 else []
        experts = f"EP{self.gpus}" if self.expert_parallel else f"experts split {self.gpus} ways"
        return " + ".join([*parts, experts]) if self.gpus > 1 else "one GPU"


@dataclass(frozen=True)
class RankBytes:
    """One GPU's weights by group (bytes) and the KV bytes one token of a sequence it serves
    costs it (every KV arena, all layers)."""

    weights: dict[str, int]
    kv_per_token: int

    @property
    def total(self) -> int:
        return sum(self.weights.values())


def group_of(name: str) -> str:
    """The weight group of the parameter `name`."""
    return next(group for group, pattern in GROUPS if pattern.search(name))


def build_on_meta(config: dict[str, Any], layout: Layout) -> torch.nn.Module:
    """Rank 0's model of `config` (a latent-MoE checkpoint's config.json) under `layout`, on
    the meta device, built by the line that claims the config."""
    from pegainfer.core.distributed.parallel import ParallelGroup
    from pegainfer.core.model import ModelContext
    from pegainfer.core.plugins import detect_model_line, model_lines

    line = detect_model_line(config, model_lines())
    ctx = ModelContext(
        Path("."), config, torch.bfloat16, torch.device("meta"),
        parallel=ParallelGroup(0, layout.tensor_parallel),
        expert_parallel=layout.expert_parallel,
        data_parallel=ParallelGroup(0, layout.data_parallel), random_weights=True,
    )  # fmt: skip
    return line.build_model(ctx)


def shape_config(shape: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json `make-checkpoint SHAPE` writes (with `overrides`)."""
    with tempfile.TemporaryDirectory() as tmp:
        write_weights(shape, Path(tmp), overrides=overrides, weights=False)
        return json.loads((Path(tmp) / "config.json").read_text())


def rank_bytes(config: dict[str, Any], layout: Layout) -> RankBytes:
    model = build_on_meta(config, layout)
    weights = dict.fromkeys(dict(GROUPS), 0)
    for name, param in model.named_parameters():
        weights[group_of(name)] += param.numel() * param.element_size()
    kv = sum(spec.bytes_per_block for spec in model.kv_arenas(BLOCK_SIZE)) // BLOCK_SIZE
    return RankBytes(weights, kv)


@dataclass(frozen=True)
class Budget:
    """What a GPU gives the KV cache, as the engine sizes it (`core.runner.memory`): its memory
    times `--gpu-memory-utilization`, less the weights, what a step needs at its peak (measured
    by a profiling step at start; estimated here), the CUDA context and communicators, and the
    engine's fixed reserve for CUDA graphs."""

    gpu_gib: float = 139.8  # an H200 as torch sees it (docs/benchmarks/2026-11-30-qwen3-h200)
    utilization: float = 0.90
    step_peak_gib: float = 4.0
    context_gib: float = 1.5
    graph_reserve_gib: float = 1.0

    def kv_bytes(self, weights: int) -> int:
        held = self.step_peak_gib + self.context_gib + self.graph_reserve_gib
        return int((self.gpu_gib * self.utilization - held) * 2**30) - weights


# The layouts docs/full-size-8xh200.md plans (its tables: `markdown_tables`).
DOC_PLANS: tuple[tuple[str, Layout], ...] = (
    ("kimi-k2-int4", Layout(data_parallel=8)),
    ("kimi-k2-int4", Layout(tensor_parallel=8)),
    ("kimi-k2-fp8", Layout(data_parallel=8)),
    ("kimi-k2-fp8", Layout(tensor_parallel=8)),
    ("kimi-k2-fp8", Layout(data_parallel=16)),
    ("glm5-fp8", Layout(data_parallel=8)),
    ("glm5-fp8", Layout(tensor_parallel=8)),
)
LONG_CONTEXT = 131072


def markdown_tables(
    plans: tuple[tuple[str, Layout], ...], budgets: tuple[Budget, ...]
) -> tuple[str, str]:
    """Two tables: each plan's weights per GPU by group (GB), and its KV room under each of
    `budgets` (in the system: data-parallel ranks hold their own sequences, tensor-parallel
    ones every sequence's whole latent)."""
    sized = [(shape, layout, rank_bytes(shape_config(shape), layout)) for shape, layout in plans]
    groups = list(dict(GROUPS))
    head = ["checkpoint", "layout", *groups, "total GB", "total GiB"]
    weights = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape, layout, plan in sized:
        cells = [f"{plan.weights[group] / 1e9:.2f}" for group in groups]
        weights.append(f"| {shape} | {layout.describe()} | " + " | ".join(cells)
                       + f" | {plan.total / 1e9:.1f} | {plan.total / 2**30:.1f} |")  # fmt: skip
    head = ["checkpoint", "layout", "KV bytes per token per GPU"]
    for budget in budgets:
        head += [f"KV GiB per GPU at {budget.utilization:.2f}", "tokens per GPU",
                 f"{LONG_CONTEXT // 1024}k sequences in all"]  # fmt: skip
    kv = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape, layout, plan in sized:
        cells = [shape, layout.describe(), f"{plan.kv_per_token:,}"]
        for budget in budgets:
            room = budget.kv_bytes(plan.total)
            tokens = max(room, 0) // plan.kv_per_token
            cells += [f"{room / 2**30:.1f}", f"{tokens:,}",
                      f"{tokens * layout.data_parallel / LONG_CONTEXT:.1f}"]  # fmt: skip
        kv.append("| " + " | ".join(cells) + " |")
    return "\n".join(weights) + "\n", "\n".join(kv) + "\n"


# The budgets the doc's KV table uses: the engine's default utilization and a tighter one.
DOC_BUDGETS = (Budget(utilization=0.90), Budget(utilization=0.95))


def main(args: argparse.Namespace) -> dict[str, Any]:
    if args.markdown:
        print(*markdown_tables(DOC_PLANS, DOC_BUDGETS), sep="\n", end="")
        return {}
    cuts = {"num_hidden_layers": args.num_layers, "n_routed_experts": args.num_experts}
    config = shape_config(args.shape, {key: n for key, n in cuts.items() if n is not None})
    layout = Layout(args.data_parallel_size, args.tensor_parallel_size, True)
    plan = rank_bytes(config, layout)
    depth = f"{config['num_hidden_layers']} layers, {config['n_routed_experts']} experts"
    print(f"{args.shape} ({depth}), {layout.describe()}: bytes per GPU")
    for group, size in plan.weights.items():
        print(f"  {group:16s} {size / 1e9:9.3f} GB")
    print(f"  {'total':16s} {plan.total / 1e9:9.3f} GB ({plan.total / 2**30:.2f} GiB)")
    print(f"  KV per token of a sequence it serves: {plan.kv_per_token} bytes")
    return {"shape": args.shape, "layout": layout.describe(), "weights": plan.weights,
            "total": plan.total, "kv_per_token": plan.kv_per_token}  # fmt: skip


def add_parser(subparsers: Any) -> None:
    parser = subcommand(subparsers, "memory-plan", __doc__)
    parser.add_argument(
        "shape", nargs="?", default="kimi-k2-int4", choices=sorted(LATENT_MOE_SHAPES),
        help="which checkpoint (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--data-parallel-size", type=int, default=1)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument(
        "--num-layers", type=int, default=None, help="layers (default: the shape's)"
    )
    parser.add_argument(
        "--num-experts", type=int, default=None, help="routed experts (default: the shape's)"
    )
    parser.add_argument(
        "--markdown", action="store_true",
        help="print docs/full-size-8xh200.md's tables (every planned layout) instead",
    )  # fmt: skip
    parser.set_defaults(run=main)
