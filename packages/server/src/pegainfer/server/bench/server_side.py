"""Where the server says a run's time went: its `/metrics` before and after, as deltas.

A client sees TTFT as one number; the server splits it (vLLM's names) into waiting to be
scheduled and scheduled-to-first-token, and counts the tokens of every engine step. Reading
both sides of one run tells queueing apart from slow steps. Servers without these metrics (or
without `/metrics`) give an empty breakdown; the client-side figures do not depend on it.
"""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pegainfer.server.bench.client import BenchClient

_PHASES = ("queue", "prefill", "decode", "inference")
_SAMPLES = [f"vllm:request_{phase}_time_seconds" for phase in _PHASES] + [
    "vllm:iteration_tokens_total"
]


async def scrape(client: BenchClient) -> dict[str, float]:
    """The `_sum` and `_count` of the histograms the breakdown reads, summed over labels."""
    try:
        response = await client.http.get(client.base_url + "/metrics")
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            base = sample.name.removesuffix("_sum").removesuffix("_count")
            if base in _SAMPLES and sample.name != base:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Mean milliseconds per finished request in each phase, and the engine steps of the run
    (how many, mean tokens each); empty when the server did not report them."""
    if not after:
        return {}

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    result: dict[str, Any] = {}
    for phase in _PHASES:
        name = f"vllm:request_{phase}_time_seconds"
        count = delta(name + "_count")
        if count > 0:
            result[f"mean_{phase}_ms"] = 1000 * delta(name + "_sum") / count
    steps = delta("vllm:iteration_tokens_total_count")
    if steps > 0:
        result["engine_steps"] = int(steps)
        result["mean_step_tokens"] = delta("vllm:iteration_tokens_total_sum") / steps
    return result


def report_rows(server: dict[str, Any]) -> list[tuple[str, Any]]:
    """The breakdown as rows of a benchmark report."""
    labels = {
        "mean_queue_ms": "Server mean queue time (ms):",
        "mean_prefill_ms": "Server mean scheduled-to-first-token (ms):",
        "mean_decode_ms": "Server mean decode time (ms):",
        "engine_steps": "Server engine steps:",
        "mean_step_tokens": "Server mean tokens per step:",
    }
    return [(label, server[key]) for key, label in labels.items() if key in server]
