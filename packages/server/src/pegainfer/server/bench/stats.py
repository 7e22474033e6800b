"""Summaries of request results: percentiles, latency metrics and peaks, as vLLM computes them.

Every benchmark reports through these, so that a TPOT or a p99 means the same thing everywhere.
An empty sample summarises to 0.0, as `vllm bench serve` reports it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pegainfer.server.bench.client import RequestResult


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile with linear interpolation between ranks (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def tpot(result: RequestResult) -> float | None:
    """Time per output token after the first; None for outputs of fewer than two tokens."""
    if result.output_len < 2:
        return None
    return (result.latency - result.ttft) / (result.output_len - 1)


def latency_summary(results: Sequence[RequestResult]) -> dict[str, float]:
    """Mean, median and p99 in ms of TTFT, TPOT, ITL and end-to-end latency of the successes.

    Keys follow vLLM's result files: `mean_ttft_ms`, `median_tpot_ms`, `p99_e2el_ms`, ...
    """
    done = [r for r in results if r.success]
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": [t for t in map(tpot, done) if t is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    summary: dict[str, float] = {}
    for name, values in samples.items():
        summary[f"mean_{name}_ms"] = mean(values) * 1000
        summary[f"median_{name}_ms"] = percentile(values, 50) * 1000
        summary[f"p99_{name}_ms"] = percentile(values, 99) * 1000
    return summary


def token_totals(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    """Request and token counts of a run and their rates over `duration` seconds."""
    done = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_len for r in done)
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "total_cached_tokens": sum(r.cached_tokens or 0 for r in done),
        "request_throughput": len(done) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """Most successful requests in flight at once, over half-open [start, start + latency)."""
    events = sorted(
        (t, step)
        for r in results
        if r.success
        for t, step in ((r.start_time, 1), (r.start_time + r.latency, -1))
    )  # at equal times -1 sorts first: a request ending as another starts is not overlap
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


def peak_output_throughput(results: Sequence[RequestResult]) -> float:
    """Most output tokens streamed in any one-second bucket counted from the first send.

    A token's time is its chunk's arrival (start + TTFT + the ITLs so far), as vLLM buckets them.
    """
    done = [r for r in results if r.success]
    if not done:
        return 0.0
    origin = min(r.start_time for r in done)
    buckets: dict[int, int] = {}
    for r in done:
        t = r.start_time + r.ttft
        times = [t]
        for gap in r.itl:
            t += gap
            times.append(t)
        for token_time in times:
            second = int(token_time - origin)
            buckets[second] = buckets.get(second, 0) + 1
    return float(max(buckets.values()))
