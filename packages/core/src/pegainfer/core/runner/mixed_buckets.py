"""Which token counts the piecewise graphs of mixed steps are captured for, and which of them
before the engine is ready.

The pieces pay only while a step is launch-bound: an eager mixed step launches about a thousand
kernels from Python (issue 19's profile: ~1,000 launches at 27-48 us each, ~30 ms of host work
for Qwen3-4B), and under async scheduling that work overlaps the step before it on the GPU. Once
a step's GPU time clearly exceeds its eager launch time, a graph saves nothing the overlap does
not already hide, and costs a capture (an eager forward of the bucket and its segments' capture,
tens of ms each) and pool memory: each bucket's pieces keep their cuts' inputs (every layer's
queries) and final states for good, 298 KiB a token for Qwen3-4B (`held_bytes_per_token`), so
the pool grows with the sum of the buckets: about 40 GB for every 256 tokens up to an
8,192-token budget, 1.4 GB for the ten buckets up to 1,536 planned here (KV sizing reserves it:
`runner/memory.py`). So the buckets stop at `launch_bound_tokens`, the token count at which a
step's matmuls alone, at a conservative matmul rate, take as long as an eager step's launches;
larger steps run eagerly. Below it the buckets are powers of two up to 256 (where the step is
launch-bound and padding costs little), then 1.5x steps (2^k and 3 * 2^(k-1): padding at most
1.5x where the GPU time starts to count), so a budget of any size has at most two buckets per
doubling up to the cap: ten for Qwen3-4B where every 256 tokens up to an 8,192-token budget made
37 (a start that did not finish in minutes).

The buckets up to `FIRST_MAX_TOKENS` (short prompts, prefix-hit tails: the steps a lightly
loaded server runs) are captured before the engine is ready; a step whose bucket is still
missing captures it first, and an idle engine captures the rest (`MixedGraphs`).
"""

from __future__ import annotations

from pegainfer.core.matmul_weights import matmul_flops_per_token
from pegainfer.core.model import Model

#: The host time of one eager mixed step: ~1,000 launches at ~30 us (issue 19's profile of
#: Qwen3-4B at 7e9ab0f: 27-48 us each).
EAGER_STEP_HOST_S = 30e-3
#: A matmul rate a mixed step's GEMMs reach (FLOP/s): half the bf16 rate measured on an H200
#: (787 TFLOP/s); a 1,024-token prefill ran at 0.59 of it. Conservative: the lower the rate,
#: the longer the step's GPU time is assumed to be and the fewer buckets get graphs.
MATMUL_RATE = 400e12
#: Buckets captured before the engine is ready.
FIRST_MAX_TOKENS = 256
#: The smallest bucket: fewer tokens pad up to it.
SMALLEST = 16


def _series(limit: int) -> list[int]:
    """The bucket sizes of at most `limit` tokens: powers of two from 16 to 256, then 384,
    512, 768, 1024, 1536, ... (2^k and 3 * 2^(k-1))."""
    sizes, size = [], SMALLEST
    while size <= limit:
        sizes.append(size)
        if size >= FIRST_MAX_TOKENS and size * 3 // 2 <= limit:
            sizes.append(size * 3 // 2)
        size *= 2
    return sizes


def token_buckets(cap: int) -> tuple[int, ...]:
    """The series up to `cap`, and `cap` itself: a step of n tokens pads to at most
    max(2n, 16) tokens below 256 and to 1.5n above."""
    if cap < 1:
        raise ValueError(f"the largest mixed-step bucket must be positive, got {cap}")
    return tuple(sorted({*_series(cap), cap}))


def first_token_buckets(buckets: tuple[int, ...]) -> tuple[int, ...]:
    """The buckets captured before serving: those of at most `FIRST_MAX_TOKENS` tokens (the
    smallest one at least, whatever its size)."""
    return tuple(b for b in buckets if b <= FIRST_MAX_TOKENS) or buckets[:1]


def launch_bound_tokens(flops_per_token: float) -> int:
    """The token count at which a step's matmuls, at `MATMUL_RATE`, take `EAGER_STEP_HOST_S`:
    steps larger than it are GPU-bound even when launched eagerly."""
    return max(SMALLEST, int(EAGER_STEP_HOST_S * MATMUL_RATE / flops_per_token))


def graph_token_cap(model: Model, budget: int, requested: int | None = None) -> int:
    """The largest mixed-step bucket: `requested` (the user's, at most the step's `budget`) or
    the largest bucket of the series within `launch_bound_tokens` of the model's FLOPs per
    token, or the budget if that is smaller."""
    if requested is not None:
        return requested
    bound = launch_bound_tokens(matmul_flops_per_token(model))
    return budget if bound >= budget else _series(bound)[-1]
