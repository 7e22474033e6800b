"""Expert parallelism beside data-parallel attention: each rank holds its own sequences and a
range of whole routed experts, so each MoE layer sends every token to the ranks that hold its
chosen experts (all-to-all), computes the (token, expert) pairs that arrive, and sends the
results back (all-to-all again) to be summed where the token lives.

Sends have a fixed capacity: every rank sends every peer room for `capacity` tokens, the most
any rank has this step (a token goes to a peer at most once, whatever its top-k), with the
tokens that need that peer packed first and the rest padding whose experts are -1 (no pairs).
Every rank then knows the sizes without exchanging counts, nothing reads device values on the
host, and a CUDA graph can capture the exchange (DeepEP's low-latency mode sends the same
way). The cost: the collective moves the whole capacity, 2 x world x capacity x hidden values
per layer and rank, whatever the routing; sends sized by exchanged counts would move only the
tokens that need a peer, and pay for it with a host sync per layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pegainfer.core.distributed.parallel import ParallelGroup

#: compute(x [n, H], weights [n, k] float32, experts [n, k] int32) -> [n, H]: the weighted
#: sum of each row's chosen experts held on this rank (rows whose experts are all -1: zeros).
ExpertCompute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def exchange(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    experts_per_rank: int,
    capacity: int,
    group: ParallelGroup,
    compute: ExpertCompute,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]) for this rank's tokens x [T, H]
    (T <= capacity; `experts` int32 or int64), expert e held by rank e // experts_per_rank."""
    world, (tokens, hidden), top_k = group.world_size, x.shape, experts.shape[1]
    device = x.device
    needs = torch.zeros(tokens, world, dtype=torch.bool, device=device)
    needs.scatter_(1, (experts // experts_per_rank).long(), True)
    # Token t's row in the send buffer: peer p's block, after the earlier tokens that need p;
    # pairs (t, p) that are not needed go to one spill row past the end, never sent.
    place = needs.long().cumsum(0) - 1 + torch.arange(world, device=device) * capacity
    spill = world * capacity
    dest = torch.where(needs, place, spill).flatten()
    # A row: the token, then its experts (int32 bits) and weights (float32) as x's dtype.
    meta = torch.cat((experts.int().view(torch.float32), weights.float()), dim=1).view(x.dtype)
    send = x.new_zeros(spill + 1, hidden + meta.shape[1])
    send[:, hidden : hidden + meta.shape[1] // 2].view(torch.int32).fill_(-1)  # padding: none
    send[dest] = _per_peer(torch.cat((x, meta), dim=1), world)
    received = group.all_to_all(send[:spill])
    received_meta = received[:, hidden:].contiguous().view(torch.float32)
    received_experts = received_meta[:, :top_k].contiguous().view(torch.int32)
    results = compute(received[:, :hidden].contiguous(), received_meta[:, top_k:].contiguous(),
                      received_experts)  # fmt: skip
    returned = torch.cat((group.all_to_all(results), results.new_zeros(1, hidden)))
    return returned[dest].view(tokens, world, hidden).float().sum(dim=1).to(x.dtype)


def _per_peer(rows: torch.Tensor, world: int) -> torch.Tensor:
    """Each row `world` times in a row (`dest`'s token-major order); unlike
    `repeat_interleave`, no device value sizes the output (a graph can capture it)."""
    return rows[:, None].expand(-1, world, -1).reshape(-1, rows.shape[1])
