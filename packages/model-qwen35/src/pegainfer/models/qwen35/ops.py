"""Qwen3.5's own operations as torch reference ops, one sequence at a time.

These define the semantics the GPU kernels are tested against, following transformers'
`modeling_qwen3_5` casts: the gated RMSNorm of the DeltaNet output, the causal depthwise conv1d
with its state, and the gated delta rule in its recurrent form (decode) and its chunked form
(prefill, which may continue from a saved state). Partial rotary embeddings are core's
`RotaryEmbedding` over the first `head_dim * partial_rotary_factor` dims, and the zero-centred
RMSNorm `norm(x) * (1 + w)` is core's `rms_norm(..., zero_centred=True)`. The recurrence, per value
head with state S [dk, dv]:

    S <- exp(g_t) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`weight * norm(x) * silu(gate)` over the last dimension (the DeltaNet output norm; its
    weight is used as is, not as 1 + w). The norm is rounded to x's dtype before the weight."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed) * F.silu(gate.float())).to(x.dtype)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d then SiLU over one sequence's x [T, C], continuing from `state`
    [C, K - 1] (the K - 1 inputs before x, zeros for a fresh sequence); weight is [C, K].

    Returns the output [T, C] in x's dtype and the new state (the last K - 1 inputs, in the
    state's dtype). The convolution runs in the weight's dtype, as transformers runs it.
    """
    width = weight.shape[1]
    window = torch.cat((state.to(weight.dtype), x.t().to(weight.dtype)), dim=1)  # [C, K-1+T]
    out = F.conv1d(window[None], weight[:, None, :], groups=weight.shape[0])[0]  # [C, T]
    new_state = window[:, window.shape[1] - (width - 1) :].to(state.dtype)
    return F.silu(out).t().to(x.dtype), new_state


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token. q, k [T, H, dk] (normalised and scaled by the caller,
    one per value head), v [T, H, dv], g and beta [T, H], state [H, dk, dv]; all float32.
    Returns o [T, H, dv] and the final state."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        read = torch.einsum("hk,hkv->hv", k[t], state)
        update = beta[t][:, None] * (v[t] - read)
        state = state + k[t][:, :, None] * update[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], state)
    return out, state


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence, a chunk of tokens at a time (same arguments and results).

    Within a chunk with cumulative log-decay c_t and incoming state S0, the updates u solve the
    unit lower-triangular system (I + A) U = beta * (V - exp(c) K S0), where
    A[t, j] = beta_t exp(c_t - c_j) k_t . k_j for j < t; then
    o_t = exp(c_t) S0^T q_t + sum_{j <= t} exp(c_t - c_j) (q_t . k_j) u_j and the chunk leaves
    S = exp(c_L) S0 + sum_j exp(c_L - c_j) k_j u_j^T.
    """
    out = torch.empty_like(v)
    qh, kh, vh = (x.transpose(0, 1) for x in (q, k, v))  # [H, T, d]
    gh, bh = g.t(), beta.t()  # [H, T]
    for start in range(0, q.shape[0], chunk_size):
        end = min(start + chunk_size, q.shape[0])
        qc, kc, vc = qh[:, start:end], kh[:, start:end], vh[:, start:end]
        bc = bh[:, start:end]
        c = gh[:, start:end].cumsum(-1)  # [H, L]
        n = end - start
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        strict = causal.tril(-1)
        gaps = c[:, :, None] - c[:, None, :]  # c_t - c_j
        decay_strict = gaps.masked_fill(~strict, float("-inf")).exp()
        decay_causal = gaps.masked_fill(~causal, float("-inf")).exp()
        system = bc[:, :, None] * (kc @ kc.transpose(-1, -2)) * decay_strict
        system = system + torch.eye(n, dtype=q.dtype, device=q.device)
        rhs = bc[:, :, None] * (vc - c.exp()[:, :, None] * (kc @ state))
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        o = c.exp()[:, :, None] * (qc @ state) + ((qc @ kc.transpose(-1, -2)) * decay_causal) @ u
        out[start:end] = o.transpose(0, 1)
        tail = (c[:, -1:] - c).exp()[:, :, None]  # exp(c_L - c_j)
        state = c[:, -1].exp()[:, None, None] * state + (kc * tail).transpose(-1, -2) @ u
    return out, state
