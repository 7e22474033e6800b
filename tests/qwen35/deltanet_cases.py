"""Cases shared by the DeltaNet kernel tests on the GPU (`test_kernels_gpu.py`) and in Triton's
interpreter on the CPU (`test_kernels_interpreted.py`): random inputs, the torch reference run
one sequence at a time, and the kernels' relative errors against it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pegainfer.models.qwen35 import ops

if TYPE_CHECKING:
    from pegainfer.models.qwen35.kernels import DecodeLaunch


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.float() - ref.float()).norm() / ref.float().norm()).item()


def delta_rule_inputs(tokens, key_heads, value_heads, dim, dtype, device, seed, slots=5):
    """A fused projection [qkv | z | b | a], a post-conv qkv, the gate parameters, and
    nonzero states in `slots` slots."""
    g = torch.Generator(device).manual_seed(seed)
    key_dim = key_heads * dim
    channels = 2 * key_dim + value_heads * dim
    width = channels + value_heads * dim + 2 * value_heads
    proj = torch.randn(tokens, width, device=device, generator=g).to(dtype)
    qkv = torch.randn(tokens, channels, device=device, generator=g).to(dtype)
    a_log = torch.rand(value_heads, device=device, generator=g).log().to(dtype)
    dt_bias = torch.randn(value_heads, device=device, generator=g).to(dtype)
    states = torch.randn(slots, value_heads, dim, dim, device=device, generator=g) * 0.1
    return proj, qkv, a_log, dt_bias, states


def reference_delta_rule(proj, qkv, a_log, dt_bias, state, key_heads, recurrent):
    """transformers' gates then the reference rule over one sequence's rows."""
    heads, dim = state.shape[0], state.shape[1]
    n, key_dim = qkv.shape[0], key_heads * dim
    b, a = proj[:, -2 * heads : -heads], proj[:, -heads:]
    beta = b.sigmoid().float()
    decay = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    q, k, v = qkv.float().split([key_dim, key_dim, heads * dim], dim=-1)
    group = heads // key_heads
    q = ops.l2_normalize(q.view(n, key_heads, dim)).repeat_interleave(group, dim=1)
    k = ops.l2_normalize(k.view(n, key_heads, dim)).repeat_interleave(group, dim=1)
    rule = ops.recurrent_gated_delta_rule if recurrent else ops.chunked_gated_delta_rule
    return rule(q * dim**-0.5, k, v.view(n, heads, dim), decay, beta, state)


def decode_errors(
    seqs: int,
    key_heads: int,
    value_heads: int,
    dim: int,
    dtype: torch.dtype,
    device: str,
    steps: int = 2,
    launch: DecodeLaunch | None = None,
) -> dict[str, float]:
    """`steps` launches of the fused decode kernel over `seqs` one-token sequences in shuffled
    slots (nonzero conv windows and states, as after earlier steps) against the reference
    conv, delta rule and gated norm run one sequence at a time: the largest relative error of
    the outputs, of the conv windows and of the states over the steps, and `arrivals`, the
    counters left nonzero. `launch`: the kernel's `DecodeLaunch` (default: its default)."""
    from pegainfer.models.qwen35.kernels import DecodeLaunch, DeltaNetShape, decode_gated_delta_net

    shape = DeltaNetShape(key_heads, value_heads, dim, dim)
    channels, num_slots = shape.conv_channels, seqs + 2
    g = torch.Generator(device).manual_seed(seqs * dim + value_heads)
    conv_weight = (0.5 * torch.randn(channels, 1, 4, device=device, generator=g)).to(dtype)
    conv_states = torch.randn(num_slots, channels, 3, device=device, generator=g).to(dtype).float()
    norm_weight = (1 + 0.1 * torch.randn(dim, device=device, generator=g)).to(dtype)
    slots = torch.randperm(num_slots, device=device, generator=g)[:seqs]
    arrivals = torch.zeros(seqs + 3, key_heads, dtype=torch.int32, device=device)
    _, _, a_log, dt_bias, states = delta_rule_inputs(
        1, key_heads, value_heads, dim, dtype, device, seed=seqs, slots=num_slots
    )
    conv_expected, expected = conv_states.clone(), states.clone()
    errors = {"out": 0.0, "conv": 0.0, "state": 0.0, "arrivals": 0.0}
    for step in range(steps):
        proj, *_ = delta_rule_inputs(
            seqs, key_heads, value_heads, dim, dtype, device, seed=100 * step + seqs
        )
        z = proj[:, channels : channels + value_heads * dim].view(seqs, value_heads, dim)
        out = decode_gated_delta_net(
            proj, conv_weight, conv_states, a_log, dt_bias, norm_weight, 1e-6, states, slots,
            arrivals, shape, launch or DecodeLaunch(),
        )  # fmt: skip
        ref = torch.empty_like(out)
        for i, slot in enumerate(slots.tolist()):
            one = slice(i, i + 1)
            qkv, conv_expected[slot] = ops.causal_conv1d(
                proj[one, :channels], conv_weight[:, 0], conv_expected[slot]
            )
            o, expected[slot] = reference_delta_rule(
                proj[one], qkv, a_log, dt_bias, expected[slot], key_heads, recurrent=True
            )
            ref[one] = ops.gated_rms_norm(o.to(dtype), z[one], norm_weight, 1e-6)
        errors["out"] = max(errors["out"], rel_err(out, ref))
        errors["conv"] = max(errors["conv"], rel_err(conv_states, conv_expected))
        errors["state"] = max(errors["state"], rel_err(states, expected))
        errors["arrivals"] += arrivals.count_nonzero().item()
    return errors
