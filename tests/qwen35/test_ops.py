"""Qwen3.5's reference ops against transformers' own functions and modules (float32)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from pegainfer.core.ops.rms_norm import rms_norm
from pegainfer.core.ops.rotary import RotaryEmbedding
from pegainfer.models.qwen35 import ops

TOL = 1e-5


def close(ours: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    assert (ours.float() - ref.float()).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_and_gated_norms(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=g).to(dtype)
    gate = torch.randn(7, 3, 64, generator=g).to(dtype)
    norm = hf.Qwen3_5RMSNorm(64, eps=1e-6).to(dtype)
    gated = hf.Qwen3_5RMSNormGated(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(0, 0.1, generator=g)
        gated.weight.normal_(1, 0.1, generator=g)
        close(rms_norm(x, norm.weight, 1e-6, zero_centred=True), norm(x), 0)
        close(ops.gated_rms_norm(x, gate, gated.weight, 1e-6), gated(x, gate), 0)


def test_core_rotary_is_qwen35s_partial_rotary():
    """Core's RotaryEmbedding over the first quarter of the head is Qwen3.5's M-RoPE for text."""
    config = hf.Qwen3_5TextConfig(hidden_size=64, num_attention_heads=2, head_dim=64,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                   "partial_rotary_factor": 0.25})  # fmt: skip
    positions = torch.tensor([0, 1, 5, 17, 300])
    q = torch.randn(1, 2, 5, 64, generator=torch.Generator().manual_seed(1))
    cos, sin = hf.Qwen3_5TextRotaryEmbedding(config)(q, positions[None])
    ref, _ = hf.apply_rotary_pos_emb(q, q, cos, sin)
    ours = RotaryEmbedding(16, 1e7, 400, torch.device("cpu")).apply(q[0].transpose(0, 1), positions)
    close(ours, ref[0].transpose(0, 1), 0)


def test_causal_conv1d_fresh_continued_and_decoded():
    g = torch.Generator().manual_seed(2)
    channels, width, length = 24, 4, 13
    x = torch.randn(length, channels, generator=g)
    weight = torch.randn(channels, width, generator=g)
    ref = hf.causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()
    zeros = torch.zeros(channels, width - 1)
    out, _ = ops.causal_conv1d(x, weight, zeros)
    close(out, ref)
    # In two pieces, the second from the first's state; then one token against HF's update.
    first, state = ops.causal_conv1d(x[:6], weight, zeros)
    second, state = ops.causal_conv1d(x[6:], weight, state)
    close(torch.cat((first, second)), ref)
    hf_state = x[-(width - 1) :].t()[None].clone()
    token = torch.randn(1, channels, generator=g)
    hf_out = hf.causal_conv1d_update(token.t()[None], hf_state, weight, None, "silu")[0].t()
    ours_out, state = ops.causal_conv1d(token, weight, state)
    close(ours_out, hf_out)
    close(state, hf_state[0])


def delta_rule_inputs(length: int, seed: int, k_heads: int = 2, v_heads: int = 4, dim: int = 16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, length, k_heads, dim, generator=g)
    k = torch.randn(1, length, k_heads, dim, generator=g)
    v = torch.randn(1, length, v_heads, dim, generator=g)
    decay = -torch.rand(1, length, v_heads, generator=g) * 2  # log-decay <= 0
    beta = torch.rand(1, length, v_heads, generator=g)
    state = torch.randn(1, v_heads, dim, dim, generator=g) * 0.1
    return q, k, v, decay, beta, state


def prepared(q, k, v, decay, beta):
    """What the layer hands our ops: one sequence, q/k normalised, q scaled, heads expanded."""
    rep = v.shape[2] // q.shape[2]
    qn = ops.l2_normalize(q[0]).repeat_interleave(rep, dim=1) * q.shape[-1] ** -0.5
    kn = ops.l2_normalize(k[0]).repeat_interleave(rep, dim=1)
    return qn, kn, v[0], decay[0], beta[0]


@pytest.mark.parametrize("length", [1, 5, 64, 100, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_gated_delta_rule_forms_match_transformers(length, with_state):
    q, k, v, decay, beta, state = delta_rule_inputs(length, seed=length)
    initial = state if with_state else None
    args = dict(initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_out, ref_state = hf.torch_chunk_gated_delta_rule(q, k, v, decay, beta, **args)
    start = state[0] if with_state else torch.zeros_like(state[0])
    for form in (ops.chunked_gated_delta_rule, ops.recurrent_gated_delta_rule):
        out, final = form(*prepared(q, k, v, decay, beta), start)
        close(out, ref_out[0], 1e-4)
        close(final, ref_state[0], 1e-4)


def test_chunked_prefill_continues_from_a_saved_state():
    q, k, v, decay, beta, state = delta_rule_inputs(150, seed=7)
    inputs = prepared(q, k, v, decay, beta)
    whole, whole_state = ops.chunked_gated_delta_rule(*inputs, state[0])
    cut = 70  # not a chunk boundary
    first, mid = ops.chunked_gated_delta_rule(*(x[:cut] for x in inputs), state[0])
    second, end = ops.chunked_gated_delta_rule(*(x[cut:] for x in inputs), mid)
    close(torch.cat((first, second)), whole, 1e-4)
    close(end, whole_state, 1e-4)


def test_chunk_plan_breaks_at_checkpoints():
    from pegainfer.models.qwen35.kernels import ChunkPlan

    seq_chunks, starts, ends, snaps = ChunkPlan.host_lists(
        [(0, 150, None), (150, 151, None), (151, 281, (66, 9))]
    )
    assert seq_chunks == [0, 3, 4, 7]
    assert list(zip(starts, ends, snaps, strict=True)) == [
        (0, 64, -1), (64, 128, -1), (128, 150, -1), (150, 151, -1),
        (151, 215, -1), (215, 217, 9), (217, 281, -1),
    ]  # fmt: skip


def test_conv_tiles_cut_each_sequence():
    from pegainfer.models.qwen35.kernels import CONV_TILE, conv_tiles

    assert CONV_TILE == 32
    assert conv_tiles([0, 1, 71, 72, 104]) == ([0, 1, 1, 1, 2, 3], [0, 1, 33, 65, 71, 72])


def test_mixed_step_plan_sends_decodes_to_the_recurrent_kernel():
    """A mixed step's one-token sequences go to the recurrent kernel by row and slot; only
    the longer chunks (and a one-token chunk checkpointed at its end) are planned in chunks;
    the plan is built on the host and copied once, with no device round trip."""
    from pegainfer.core.runner.forward_batch import ForwardBatch
    from pegainfer.models.qwen35.model import DeltaNetStep

    lengths, starts = [1, 90, 1, 1, 1], [10, 0, 33, 5, 60]
    batch = ForwardBatch.build(
        [[1] * n for n in lengths], starts, [list(range(8))] * 5, [True] * 5, 16,
        torch.device("cpu"), state_slots=[3, 0, 5, 2, 4],
        state_snapshot=[None, (64, 7), (0, 6), (1, 1), None],
    )  # fmt: skip
    arrivals = torch.zeros(8, 2, dtype=torch.int32)  # the fused decode kernel's, when on
    step = DeltaNetStep.of(batch, None, arrivals)
    assert step.arrivals is None  # a mixed step's decodes stay in the recurrent kernel
    assert step.bounds.tolist() == [0, 1, 91, 92, 93, 94] and step.max_len == 90
    # The decode checkpointed at offset 0 is checkpointed before the step: still a decode.
    assert step.recurrent_rows.tolist() == [0, 91, 93]
    assert step.recurrent_slots.tolist() == [3, 5, 4]
    chunks = step.chunks
    assert chunks.slots.tolist() == [0, 2] and chunks.seq_chunks.tolist() == [0, 2, 3]
    assert chunks.start.tolist() == [1, 65, 92] and chunks.end.tolist() == [65, 91, 93]
    assert chunks.snapshot.tolist() == [7, -1, 1]
    assert [t.tolist() for t in step.conv_tiles] == [[0, 1, 1, 1, 2, 3, 4],
                                                      [0, 1, 33, 65, 91, 92, 93]]  # fmt: skip
    offsets, snap_slots = step.conv_snapshots
    assert offsets.tolist() == [-1, 64, -1, 1, -1] and snap_slots.tolist() == [0, 7, 0, 1, 0]
    # A decode step keeps the graph-friendly form: row i is sequence i, no tiles.
    decode = ForwardBatch.build(
        [[1], [2]], [4, 9], [[0], [1]], [True, True], 16, torch.device("cpu"), state_slots=[1, 0]
    )
    step = DeltaNetStep.of(decode)
    assert step.recurrent_rows is None and step.recurrent_slots.tolist() == [1, 0]
    assert step.chunks is None and step.conv_tiles is None and step.arrivals is None
    assert DeltaNetStep.of(decode, None, arrivals).arrivals is arrivals  # fused: opt-in


def test_the_fused_decode_kernel_is_opt_in(monkeypatch):
    from pegainfer.core.errors import ConfigError
    from pegainfer.models.qwen35.model import FUSED_DECODE_ENV, fused_decode

    monkeypatch.delenv(FUSED_DECODE_ENV, raising=False)
    assert not fused_decode()
    monkeypatch.setenv(FUSED_DECODE_ENV, "1")
    assert fused_decode()
    monkeypatch.setenv(FUSED_DECODE_ENV, "yes")
    with pytest.raises(ConfigError, match="must be 0 or 1"):
        fused_decode()
