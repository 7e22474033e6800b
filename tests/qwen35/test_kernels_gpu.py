"""The Gated DeltaNet Triton kernels against the torch reference ops (CUDA; skipped elsewhere).

Each test builds a step of several sequences in their state slots (nonzero states, as after
earlier steps), runs the kernel over the whole step and the reference one sequence at a time.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pegainfer.models.qwen35 import ops
from tests.qwen35.deltanet_cases import (
    decode_errors,
    delta_rule_inputs,
    reference_delta_rule,
    rel_err,
)

pytestmark = pytest.mark.gpu


def bounds_of(lengths: list[int]) -> list[int]:
    return [0, *torch.tensor(lengths).cumsum(0).tolist()]


def int32(values: list[int], device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("lengths", "channels", "snapshots"),
    [
        ([1, 1, 1], 8192, None),  # a decode step: one program per sequence, no tiles
        ([5, 1, 40], 384, None),
        ([2, 70, 33], 320, [(1, 5), -1, (33, 4)]),  # checkpoints inside and at the end
        ([100], 8192, [(64, 3)]),
        ([1, 2, 1], 320, None),  # shorter than the window
    ],
)
def test_causal_conv1d(dtype, lengths, channels, snapshots, device="cuda"):
    from pegainfer.models.qwen35.kernels import causal_conv1d, conv_tiles

    g = torch.Generator(device).manual_seed(channels + len(lengths))
    x = torch.randn(sum(lengths), channels, device=device, generator=g).to(dtype)
    weight = (torch.randn(channels, 1, 4, device=device, generator=g) * 0.5).to(dtype)
    states = torch.randn(6, channels, 3, device=device, generator=g).to(dtype).float()
    slots = [2, 0, 1][: len(lengths)]
    bounds = bounds_of(lengths)
    snap_args = None
    if snapshots is not None:
        offsets = [-1 if s == -1 else s[0] for s in snapshots]
        snap_slots = [0 if s == -1 else s[1] for s in snapshots]
        snap_args = (int32(offsets, device), int32(snap_slots, device))
    tiles = None if max(lengths) == 1 else tuple(int32(t, device) for t in conv_tiles(bounds))
    expected = states.clone()
    out = causal_conv1d(
        x, weight, states, int32(slots, device), int32(bounds, device), max(lengths), tiles,
        snap_args,
    )  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for i, slot in enumerate(slots):
        rows = slice(bounds[i], bounds[i + 1])
        start_state = expected[slot].clone()
        ref, expected[slot] = ops.causal_conv1d(x[rows], weight[:, 0], start_state)
        assert rel_err(out[rows], ref) < tol
        if snapshots is not None and snapshots[i] != -1:
            offset, target = snapshots[i]
            _, expected[target] = ops.causal_conv1d(x[rows][:offset], weight[:, 0], start_state)
    assert rel_err(states, expected) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("seqs", "key_heads", "value_heads", "dim"), [(4, 16, 32, 128), (3, 2, 4, 64)]
)
def test_recurrent_gated_delta_rule(dtype, seqs, key_heads, value_heads, dim, device="cuda"):
    from pegainfer.models.qwen35.kernels import DeltaNetShape, recurrent_gated_delta_rule

    proj, qkv, a_log, dt_bias, states = delta_rule_inputs(
        seqs, key_heads, value_heads, dim, dtype, device, seed=dim + seqs
    )
    slots = list(range(seqs))[::-1]
    expected = states.clone()
    shape = DeltaNetShape(key_heads, value_heads, dim, dim)
    out = recurrent_gated_delta_rule(
        qkv, proj, a_log, dt_bias, states, torch.tensor(slots, device=device), shape
    )
    for i, slot in enumerate(slots):
        rows = slice(i, i + 1)
        ref, expected[slot] = reference_delta_rule(
            proj[rows], qkv[rows], a_log, dt_bias, expected[slot], key_heads, recurrent=True
        )
        assert rel_err(out[rows], ref) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel_err(states, expected) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("key_heads", "value_heads", "dim"),
    [(16, 32, 128), (2, 4, 64), (4, 4, 64), (1, 3, 32)],  # 4B's heads; smaller; groups of 1, 3
)
@pytest.mark.parametrize("seqs", [1, 3, 16, 64])
def test_decode_gated_delta_net(dtype, key_heads, value_heads, dim, seqs):
    """The fused decode kernel (conv, delta rule, gated norm) over two steps against the
    reference ops one sequence at a time: outputs, conv windows (the q/k windows its value
    heads share included) and states; the arrival counters left at zero."""
    errors = decode_errors(seqs, key_heads, value_heads, dim, dtype, "cuda")
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    assert errors["out"] < tol, errors
    assert errors["conv"] < 1e-6 and errors["state"] < 1e-5, errors
    assert errors["arrivals"] == 0, errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block", "num_warps"), [(8, 1), (16, 4), (32, 8), (64, 4), (128, 8)])
@pytest.mark.parametrize(("key_heads", "value_heads", "seqs"), [(16, 32, 16), (2, 6, 3), (4, 4, 2)])
def test_decode_gated_delta_net_launches(dtype, block, num_warps, key_heads, value_heads, seqs):
    """The fused decode kernel at launches like those `benchmarks/qwen35_delta_rule.py` times
    (every block size, one to eight warps): value blocks of part of a head (the last program
    normalises) and of a whole head (each program normalises its own), at Qwen3.5-4B's heads
    and at groups of three and one. Warps change the layouts, and so which threads share an
    element."""
    from pegainfer.models.qwen35.kernels import DecodeLaunch

    launch = DecodeLaunch(block, num_warps)
    errors = decode_errors(seqs, key_heads, value_heads, 128, dtype, "cuda", launch=launch)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    assert errors["out"] < tol, errors
    assert errors["conv"] < 1e-6 and errors["state"] < 1e-5, errors
    assert errors["arrivals"] == 0, errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("lengths", "snapshots", "key_heads", "value_heads", "dim"),
    [
        ([150, 1, 64, 7], [None, None, None, None], 2, 4, 64),
        ([200, 65], [(128, 3), (65, 4)], 2, 4, 64),  # checkpoints at a chunk edge and the end
        ([300], [(100, 4)], 16, 32, 128),  # a checkpoint inside a chunk, Qwen3.5-4B's heads
        ([1000, 37, 129], [None, (5, 3), None], 16, 32, 128),  # a long prompt beside two
    ],
)
def test_chunked_gated_delta_rule(
    dtype, lengths, snapshots, key_heads, value_heads, dim, device="cuda"
):
    """Several sequences (lengths off the 64-token grid) from nonzero states in shuffled
    slots, checkpoints inside chunks and at their ends; outputs, final states and
    checkpoints against the float32 reference (the products are bf16 tensor-core products
    to float32 accuracy: bf16 inputs enter exactly, float32 operands in three pieces)."""
    from pegainfer.models.qwen35.kernels import ChunkPlan, DeltaNetShape, chunked_gated_delta_rule

    tokens = sum(lengths)
    proj, qkv, a_log, dt_bias, states = delta_rule_inputs(
        tokens, key_heads, value_heads, dim, dtype, device, seed=tokens
    )
    slots = [2, 0, 1, 4][: len(lengths)]
    bounds = bounds_of(lengths)
    pieces = [(bounds[i], bounds[i + 1], snapshots[i]) for i in range(len(lengths))]
    plan_lists = (slots, *ChunkPlan.host_lists(pieces))
    plan = ChunkPlan(*(int32(x, device) for x in plan_lists))
    expected = states.clone()
    shape = DeltaNetShape(key_heads, value_heads, dim, dim)
    out = torch.full((tokens, value_heads, dim), float("nan"), dtype=dtype, device=device)
    chunked_gated_delta_rule(qkv, proj, a_log, dt_bias, states, plan, shape, out)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    for i, slot in enumerate(slots):
        rows = slice(bounds[i], bounds[i + 1])
        args = (a_log, dt_bias)
        start_state = expected[slot].clone()
        ref, expected[slot] = reference_delta_rule(
            proj[rows], qkv[rows], *args, start_state, key_heads, recurrent=False
        )
        assert rel_err(out[rows], ref) < tol
        if snapshots[i] is not None:
            offset, target = snapshots[i]
            head = slice(rows.start, rows.start + offset)
            _, expected[target] = reference_delta_rule(
                proj[head], qkv[head], *args, start_state, key_heads, recurrent=False
            )
    assert rel_err(states, expected) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "heads", "dim"), [(1, 32, 128), (37, 4, 64)])
def test_gated_rms_norm(dtype, tokens, heads, dim, device="cuda"):
    from pegainfer.models.qwen35.kernels import gated_rms_norm

    g = torch.Generator(device).manual_seed(tokens)
    x = torch.randn(tokens, heads, dim, device=device, generator=g).to(dtype)
    proj = torch.randn(tokens, 3 * heads * dim + 5, device=device, generator=g).to(dtype)
    z = proj[:, heads * dim : 2 * heads * dim].view(tokens, heads, dim)
    weight = (1 + 0.1 * torch.randn(dim, device=device, generator=g)).to(dtype)
    ref = ops.gated_rms_norm(x, z, weight, 1e-6)
    assert rel_err(gated_rms_norm(x, z, weight, 1e-6), ref) < (
        1e-6 if dtype == torch.float32 else 8e-3
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "heads", "kv_heads"), [(1, 16, 4), (37, 16, 4), (5, 8, 2)])
def test_gated_attention_input_and_output_kernels(dtype, tokens, heads, kv_heads):
    """The fused q/k zero-centred norm + partial RoPE + K/V write, and the sigmoid gate,
    against the reference ops GatedAttention runs on the CPU (head_dim 256, rotary 64)."""
    from pegainfer.core.ops.paged_attention import write_kv
    from pegainfer.core.ops.rms_norm import rms_norm
    from pegainfer.core.ops.rotary import RotaryEmbedding
    from pegainfer.models.qwen35.attention_kernels import qk_norm_rope_kv_write, sigmoid_gate

    dev, head_dim, rotary, block_size, num_blocks = torch.device("cuda"), 256, 64, 16, 32
    g = torch.Generator("cuda").manual_seed(tokens + heads)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, 2 * q_size + 2 * kv_size, device=dev, generator=g).to(dtype)
    q_w, k_w = (0.1 * torch.randn(head_dim, device=dev, generator=g).to(dtype) for _ in "qk")
    rope = RotaryEmbedding(rotary, 1e7, 4096, dev)
    positions = torch.randint(0, 4096, (tokens,), device=dev, generator=g)
    slots = torch.randperm(num_blocks * block_size, device=dev, generator=g)[:tokens]
    kv = torch.zeros(num_blocks, 2, block_size, kv_heads, head_dim, device=dev, dtype=dtype)
    kv_ref = kv.clone()
    q = qk_norm_rope_kv_write(qkv, q_w, k_w, rope.cos, rope.sin, positions, slots, kv, heads,
                              kv_heads, rotary, 1e-6)  # fmt: skip

    query_gate, k, v = qkv.split([2 * q_size, kv_size, kv_size], -1)
    query_gate = query_gate.view(tokens, heads, 2 * head_dim)
    q_ref = rope.apply(rms_norm(query_gate[..., :head_dim], q_w, 1e-6, True), positions)
    k_ref = rms_norm(k.reshape(tokens, kv_heads, head_dim), k_w, 1e-6, True)
    batch = SimpleNamespace(slot_mapping=slots, block_size=block_size)
    write_kv(kv_ref, rope.apply(k_ref, positions), v.reshape(tokens, kv_heads, head_dim), batch)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel_err(q, q_ref) < tol
    assert rel_err(kv[:, 0], kv_ref[:, 0]) < tol
    assert torch.equal(kv[:, 1], kv_ref[:, 1])  # v copied, untouched blocks still zero

    out = torch.randn(tokens, q_size, device=dev, generator=g).to(dtype)
    ref = out * torch.sigmoid(query_gate[..., head_dim:].reshape(tokens, -1))
    assert rel_err(sigmoid_gate(out, qkv, heads), ref) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_net_layer_over_a_mixed_step(dtype, device="cuda"):
    """One DeltaNet layer over a mixed step through the kernels (the decodes through the
    recurrent kernel, the rest chunked) against the reference path, which runs it one
    sequence at a time: three decodes beside a fresh prompt, a continued chunk checkpointed
    inside, and a one-token chunk checkpointed at its end; the outputs and every slot's conv
    and recurrent state, checkpoints included."""
    from pegainfer.core.distributed.parallel import ParallelGroup
    from pegainfer.core.runner.forward_batch import ForwardBatch
    from pegainfer.models.qwen35.config import Qwen35Config
    from pegainfer.models.qwen35.model import DeltaNetStep, GatedDeltaNet, Qwen35ForCausalLM

    cfg = Qwen35Config.from_dict({
        "vocab_size": 64, "hidden_size": 256, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    })  # fmt: skip
    g = torch.Generator(device).manual_seed(7)
    with torch.device(device):
        layer = GatedDeltaNet(cfg, ParallelGroup()).to(dtype)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            values = torch.randn(param.shape, device=device, generator=g)
            if name == "A_log":
                values = torch.rand(param.shape, device=device, generator=g).log()
            elif name == "norm":
                values = 1 + 0.1 * values
            elif name in ("in_proj", "out_proj"):
                values = values * param.shape[1] ** -0.5
            param.copy_(values * (0.5 if name == "conv1d" else 1))
    lengths, starts = [1, 90, 1, 70, 1, 1], [10, 0, 33, 128, 5, 60]
    snapshots = [None, None, None, (40, 7), (1, 6), None]
    tables = [list(range(20 * i, 20 * i + 20)) for i in range(len(lengths))]
    batch = ForwardBatch.build(
        [[1] * n for n in lengths], starts, tables, [True] * len(lengths), 16,
        torch.device(device), state_slots=[3, 0, 5, 1, 2, 4], state_snapshot=snapshots,
    )  # fmt: skip
    conv = torch.randn(1, 8, cfg.conv_channels, 3, device=device, generator=g).to(dtype).float()
    recurrent = 0.1 * torch.randn(1, 8, 4, 64, 64, device=device, generator=g)
    Qwen35ForCausalLM._start_states(batch, conv, recurrent)
    x = torch.randn(sum(lengths), cfg.hidden_size, device=device, generator=g).to(dtype)
    conv_ref, recurrent_ref = conv.clone(), recurrent.clone()
    step = DeltaNetStep.of(batch)
    assert step.recurrent_slots is not None and step.recurrent_slots.tolist() == [3, 5, 4]
    assert step.chunks is not None and step.chunks.slots.tolist() == [0, 1, 2]
    with torch.inference_mode():
        ours = layer(x, batch, conv[0], recurrent[0], step)
        ref = layer(x, batch, conv_ref[0], recurrent_ref[0], None)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(ours, ref) < tol
    assert rel_err(conv, conv_ref) < 1e-6
    assert rel_err(recurrent, recurrent_ref) < tol
