"""Cases shared by the DeltaNet kernel tests on the GPU (`test_kernels_gpu.py`) and in Triton's
interpreter on the CPU (`test_kernels_interpreted.py`): random inputs, the torch reference run
one sequence at a time, and the kernels' relative errors against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pegainfer.models.qwen35 import ops


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
    remap: bool,
    steps: int = 2,
) -> dict[str, float]:
    """`steps` launches of the fused decode kernel over `seqs` one-token sequences in shuffled
    slots (nonzero conv windows and states, as after earlier steps), the sequences at
    shuffled rows of a longer projection when `remap`, against the reference conv, delta
    rule and gated norm run one sequence at a time: the largest relative error of the outputs,
    of the conv windows and of the states over the steps; `untouched` counts the output
    elements written outside the sequences' rows and `arrivals` the counters left nonzero."""
    from pegainfer.models.qwen35.kernels import DeltaNetShape, decode_gated_delta_net

    shape = DeltaNetShape(key_heads, value_heads, dim, dim)
    channels, num_slots = shape.conv_channels, seqs + 2
    tokens = 2 * seqs + 1 if remap else seqs
    g = torch.Generator(device).manual_seed(seqs * dim + value_heads)
    conv_weight = (0.5 * torch.randn(channels, 1, 4, device=device, generator=g)).to(dtype)
    conv_states = torch.randn(num_slots, channels, 3, device=device, generator=g).to(dtype).float()
    norm_weight = (1 + 0.1 * torch.randn(dim, device=device, generator=g)).to(dtype)
    slots = torch.randperm(num_slots, device=device, generator=g)[:seqs]
    rows = torch.randperm(tokens, device=device, generator=g)[:seqs] if remap else None
    arrivals = torch.zeros(seqs + 3, key_heads, dtype=torch.int32, device=device)
    _, _, a_log, dt_bias, states = delta_rule_inputs(
        1, key_heads, value_heads, dim, dtype, device, seed=seqs, slots=num_slots
    )
    conv_expected, expected = conv_states.clone(), states.clone()
    errors = {"out": 0.0, "conv": 0.0, "state": 0.0, "untouched": 0.0, "arrivals": 0.0}
    for step in range(steps):
        proj, *_ = delta_rule_inputs(
            tokens, key_heads, value_heads, dim, dtype, device, seed=100 * step + seqs
        )
        z = proj[:, channels : channels + value_heads * dim].view(tokens, value_heads, dim)
        out = torch.full((tokens, value_heads, dim), float("nan"), dtype=dtype, device=device)
        decode_gated_delta_net(
            proj, conv_weight, conv_states, a_log, dt_bias, norm_weight, 1e-6, states, slots,
            arrivals, shape, out, rows,
        )  # fmt: skip
        ref = out.clone()
        for i, slot in enumerate(slots.tolist()):
            row = i if rows is None else rows[i].item()
            one = slice(row, row + 1)
            qkv, conv_expected[slot] = ops.causal_conv1d(
                proj[one, :channels], conv_weight[:, 0], conv_expected[slot]
            )
            o, expected[slot] = reference_delta_rule(
                proj[one], qkv, a_log, dt_bias, expected[slot], key_heads, recurrent=True
            )
            ref[one] = ops.gated_rms_norm(o.to(dtype), z[one], norm_weight, 1e-6)
        written = torch.zeros(tokens, dtype=torch.bool, device=device)
        written[torch.arange(seqs, device=device) if rows is None else rows] = True
        errors["out"] = max(errors["out"], rel_err(out[written], ref[written]))
        errors["conv"] = max(errors["conv"], rel_err(conv_states, conv_expected))
        errors["state"] = max(errors["state"], rel_err(states, expected))
        errors["untouched"] += out[~written].isnan().logical_not().sum().item()
        errors["arrivals"] += arrivals.count_nonzero().item()
    return errors


def norm_errors(
    lengths: list[int], heads: int, dim: int, dtype: torch.dtype, device: str
) -> dict[str, float]:
    """The gated norm in place on the rows of every other sequence (chunked), the rest
    standing for decodes, which it must leave alone: its relative error against the
    reference and the count of elements it changed in the decodes' rows."""
    from pegainfer.models.qwen35.kernels import ChunkPlan, gated_rms_norm

    tokens, bounds = sum(lengths), [0, *torch.tensor(lengths).cumsum(0).tolist()]
    g = torch.Generator(device).manual_seed(tokens)
    x = torch.randn(tokens, heads, dim, device=device, generator=g).to(dtype)
    proj = torch.randn(tokens, 3 * heads * dim + 5, device=device, generator=g).to(dtype)
    z = proj[:, heads * dim : 2 * heads * dim].view(tokens, heads, dim)
    weight = (1 + 0.1 * torch.randn(dim, device=device, generator=g)).to(dtype)
    chunked = list(range(0, len(lengths), 2))
    lists = ([0] * len(chunked), *ChunkPlan.host_lists([(bounds[i], bounds[i + 1], None)
                                                        for i in chunked]))  # fmt: skip
    plan = ChunkPlan(*(torch.tensor(x, dtype=torch.int32, device=device) for x in lists))
    expected, decodes = x.clone(), torch.ones(tokens, dtype=torch.bool, device=device)
    for i in chunked:
        rows = slice(bounds[i], bounds[i + 1])
        expected[rows] = ops.gated_rms_norm(x[rows], z[rows], weight, 1e-6)
        decodes[rows] = False
    gated_rms_norm(x, z, weight, 1e-6, plan)
    changed = (x[decodes] != expected[decodes]).sum().item()
    return {"out": rel_err(x, expected), "changed": changed}
