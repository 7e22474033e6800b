"""Timings of Qwen3.5's DeltaNet kernels at Qwen3.5-4B's shapes on one GPU (issue 20).

    python benchmarks/qwen35_delta_rule.py --out delta_rule.json

For each case (one prompt of 1k or 4k tokens; 16 or 64 decodes beside a 1k-token prompt, as
one DeltaNet layer of a mixed step runs them, planned by the model's own `DeltaNetStep`): the
median time of the layer's conv, its chunked delta rule and its recurrent one, each kernel's
time at the default launch parameters (torch.profiler), and the chunked rule over a sweep of
its launch parameters (`kernels.ChunkLaunch`; with --sweep, each in a process of its own, so a
launch that faults is recorded as such and the others still run).

For each decode case (1, 16 or 64 one-token sequences: a decode step's DeltaNet layer), timed
as decode steps run it, in a CUDA graph (`graph_time`: the kernels captured for 64 layers'
states in turn, the replay's time divided by 64, so the host's launch cost is out, the gaps
between kernels are in, and the states come from HBM as in a step): the three kernels of the
default path (conv, recurrent rule, gated norm; together and each alone) against the fused
decode kernel (`kernels.decode_gated_delta_net`, opt-in) at each launch of DECODE_LAUNCHES
(value columns per program and warps: blocks of part of a head, whose last program normalises,
and of a whole head), the fastest named, beside its byte limit (its states, conv windows,
projection rows and outputs read or written once, at the copy bandwidth measured here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from collections import defaultdict

import torch
from model_step import copy_bandwidth, cuda_time
from torch.profiler import ProfilerActivity, profile

from pegainfer.core.runner.forward_batch import ForwardBatch
from pegainfer.models.qwen35 import kernels
from pegainfer.models.qwen35.model import DeltaNetStep
from pegainfer.server.bench.report import git_revision

# Qwen3.5-4B's DeltaNet layer.
SHAPE = kernels.DeltaNetShape(num_key_heads=16, num_value_heads=32, key_dim=128, value_dim=128)
CASES = {
    "prompt_1k": [1024],
    "prompt_4k": [4096],
    "decode_16_beside_1k": [1] * 16 + [1024],
    "decode_64_beside_1k": [1] * 64 + [1024],
}
DECODE_CASES = {"decode_1": 1, "decode_16": 16, "decode_64": 64}
#: Layers' states a decode case cycles through: 64 batch-1 states (128 MiB) are more than the
#: H200's L2 holds, as a step's states are once the weights between its layers have streamed.
DECODE_LAYERS = 64
DECODE_LAUNCHES = [
    kernels.DecodeLaunch(block, warps)
    for block, warps in [(8, 1), (16, 1), (16, 2), (16, 4), (32, 2), (32, 4), (32, 8), (64, 4),
                         (64, 8), (128, 4), (128, 8)]
]  # fmt: skip
DEFAULT = kernels.ChunkLaunch()
DEFAULT_DECODE = dataclasses.astuple(kernels.DecodeLaunch())
SWEEP = [
    DEFAULT,
    *(kernels.ChunkLaunch(state_block=b, state_warps=w) for b in (16, 32, 64) for w in (4, 8)),
    *(kernels.ChunkLaunch(output_block=b, output_warps=w) for b in (32, 64, 128) for w in (4, 8)),
    kernels.ChunkLaunch(intra_warps=8),
]


def run_case(
    lengths: list[int], device: torch.device, launch: kernels.ChunkLaunch = DEFAULT
) -> dict:
    g = torch.Generator(device).manual_seed(len(lengths))
    heads, dim = SHAPE.num_value_heads, SHAPE.value_dim
    channels, tokens, seqs = SHAPE.conv_channels, sum(lengths), len(lengths)
    width = channels + heads * dim + 2 * heads
    proj = torch.randn(tokens, width, device=device, generator=g).bfloat16()
    conv_weight = (0.5 * torch.randn(channels, 1, 4, device=device, generator=g)).bfloat16()
    a_log = torch.rand(heads, device=device, generator=g).log().bfloat16()
    dt_bias = torch.randn(heads, device=device, generator=g).bfloat16()
    conv_states = torch.zeros(seqs, channels, 3, device=device)
    states = torch.zeros(seqs, heads, SHAPE.key_dim, dim, device=device)
    starts = [0 if n > 1 else 1000 for n in lengths]  # decodes continue a 1k context
    tables = [[0] * -(-(start + n) // 16) for start, n in zip(starts, lengths, strict=True)]
    batch = ForwardBatch.build(
        [[1] * n for n in lengths], starts, tables, [True] * seqs, 16, device,
        state_slots=list(range(seqs)),
    )  # fmt: skip
    step = DeltaNetStep.of(batch)
    assert step.chunks is not None
    out = torch.empty(tokens, heads, dim, dtype=torch.bfloat16, device=device)

    def conv() -> torch.Tensor:
        return kernels.causal_conv1d(
            proj[:, :channels], conv_weight, conv_states, step.slots, step.bounds, step.max_len,
            step.conv_tiles, step.conv_snapshots,
        )  # fmt: skip

    qkv = conv()

    def chunked() -> None:
        kernels.chunked_gated_delta_rule(
            qkv, proj, a_log, dt_bias, states, step.chunks, SHAPE, out, launch
        )

    result: dict = {"lengths": f"{lengths.count(1)} decodes + {[n for n in lengths if n > 1]}"}
    result["conv_ms"] = 1e3 * cuda_time(conv)
    result["chunked_ms"] = 1e3 * cuda_time(chunked)
    if step.recurrent_slots is not None:
        rows, slots = step.recurrent_rows, step.recurrent_slots
        result["recurrent_ms"] = 1e3 * cuda_time(
            lambda: kernels.recurrent_gated_delta_rule(
                qkv, proj, a_log, dt_bias, states, slots, SHAPE, rows, out
            )
        )
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            conv()
            chunked()
        torch.cuda.synchronize(device)
    per_kernel: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.device_time_total > 0 and event.key.startswith("_"):
            per_kernel[event.key] += event.device_time_total / 5 / 1e3
    result["kernel_ms"] = dict(sorted(per_kernel.items()))
    return result


def graph_time(fn, reps: int) -> float:
    """Median seconds per call of `fn` replayed in a CUDA graph of the calls fn(0) ..
    fn(reps - 1)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(0)  # compiles and warms up, on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(reps):
            fn(layer)
    return cuda_time(graph.replay) / reps


def run_decode_case(seqs: int, device: torch.device, bandwidth: float) -> dict:
    """One DeltaNet layer's decode of `seqs` one-token sequences, timed over DECODE_LAYERS
    layers' states in turn (as a step reads them: from HBM, not from the L2 cache)."""
    g = torch.Generator(device).manual_seed(seqs)
    heads, dim, channels = SHAPE.num_value_heads, SHAPE.value_dim, SHAPE.conv_channels
    width = channels + heads * dim + 2 * heads
    proj = torch.randn(seqs, width, device=device, generator=g).bfloat16()
    conv_weight = (0.5 * torch.randn(channels, 1, 4, device=device, generator=g)).bfloat16()
    a_log = torch.rand(heads, device=device, generator=g).log().bfloat16()
    dt_bias = torch.randn(heads, device=device, generator=g).bfloat16()
    norm = torch.ones(dim, dtype=torch.bfloat16, device=device)
    layers = DECODE_LAYERS
    conv_states = torch.zeros(layers, seqs + 1, channels, 3, device=device)
    states = torch.randn(layers, seqs + 1, heads, SHAPE.key_dim, dim, device=device, generator=g)
    states.mul_(0.1)
    slots = torch.arange(1, seqs + 1, dtype=torch.int32, device=device)
    bounds = torch.arange(seqs + 1, dtype=torch.int32, device=device)
    arrivals = torch.zeros(seqs, SHAPE.num_key_heads, dtype=torch.int32, device=device)
    z = proj[:, channels : channels + heads * dim].view(seqs, heads, dim)

    def conv(layer: int) -> torch.Tensor:
        return kernels.causal_conv1d(
            proj[:, :channels], conv_weight, conv_states[layer], slots, bounds, 1
        )

    def recurrent(layer: int, qkv: torch.Tensor) -> torch.Tensor:
        return kernels.recurrent_gated_delta_rule(
            qkv, proj, a_log, dt_bias, states[layer], slots, SHAPE
        )

    def three_kernels(layer: int) -> None:
        kernels.gated_rms_norm(recurrent(layer, conv(layer)), z, norm, 1e-6)

    result: dict = {"sequences": seqs, "three_kernels_us": 1e6 * graph_time(three_kernels, layers)}
    qkv = conv(0)
    out = recurrent(0, qkv)
    result["each_kernel_us"] = {
        "conv": 1e6 * graph_time(conv, layers),
        "recurrent": 1e6 * graph_time(lambda layer: recurrent(layer, qkv), layers),
        "norm": 1e6 * graph_time(lambda _: kernels.gated_rms_norm(out, z, norm, 1e-6), layers),
    }
    fused_us = {}
    for launch in DECODE_LAUNCHES:

        def fused(layer: int, launch: kernels.DecodeLaunch = launch) -> None:
            kernels.decode_gated_delta_net(
                proj, conv_weight, conv_states[layer], a_log, dt_bias, norm, 1e-6, states[layer],
                slots, arrivals, SHAPE, launch,
            )  # fmt: skip

        name = f"block_{launch.block}_warps_{launch.num_warps}"
        fused_us[name] = 1e6 * graph_time(fused, layers)
    result["fused_us"] = fused_us
    result["fused_default_us"] = fused_us["block_{}_warps_{}".format(*DEFAULT_DECODE)]
    result["fused_fastest"] = min(fused_us, key=fused_us.__getitem__)
    state_bytes = 2 * seqs * (states[0, 0].numel() + channels * 3) * 4
    result["fused_limit_us"] = 1e6 * (state_bytes + 2 * proj.numel() + 2 * z.numel()) / bandwidth
    return result


def sweep(cases: list[str]) -> list[dict]:
    """The chunked rule's time per case under each launch of SWEEP, each in a fresh process
    (a fault ends only its own)."""
    rows = []
    for launch in SWEEP:
        config = json.dumps(dataclasses.asdict(launch))
        command = [sys.executable, __file__, "--cases", ",".join(cases), "--launch", config]
        run = subprocess.run(command, capture_output=True, text=True, timeout=120)
        row: dict = dataclasses.asdict(launch)
        if run.returncode != 0:
            row["error"] = run.stderr.strip().splitlines()[-1] if run.stderr else "failed"
        else:
            times = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
            row |= {t["case"]: t["chunked_ms"] for t in times}
        print(json.dumps({"sweep": row}), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    every = ",".join([*CASES, *DECODE_CASES])
    parser.add_argument("--cases", default=every, help="which of " + every)
    parser.add_argument("--sweep", action="store_true", help="also time every launch of SWEEP")
    parser.add_argument("--launch", default=None, help="a ChunkLaunch as JSON (used by --sweep)")
    args = parser.parse_args()
    device = torch.device("cuda")
    cases = args.cases.split(",")
    launch = kernels.ChunkLaunch(**json.loads(args.launch)) if args.launch else DEFAULT
    results: dict = {"revision": git_revision(), "gpu": torch.cuda.get_device_name(device)}
    if any(name in DECODE_CASES for name in cases):
        results["copy_bandwidth_gbps"] = copy_bandwidth() / 1e9
    for name in cases:
        if name in DECODE_CASES:
            bandwidth = results["copy_bandwidth_gbps"] * 1e9
            results[name] = run_decode_case(DECODE_CASES[name], device, bandwidth)
        else:
            results[name] = run_case(CASES[name], device, launch)
        print(json.dumps({"case": name, **results[name]}), flush=True)
    if args.sweep:
        results["sweep"] = sweep([name for name in cases if name in CASES])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
