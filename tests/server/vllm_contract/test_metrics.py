"""vLLM's tests/entrypoints/serve/instrumentator/test_metrics.py for the text model: every
`vllm:*` family dashboards read is served, sequential requests move each count by exactly
what vLLM's would, and aborted requests leave the running, waiting and KV-usage gauges at zero.
Counts are read as differences, the folder's server having served other modules first."""

from __future__ import annotations

import asyncio

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tests.server.helpers import metric, metrics, tokenize, wait_until

PROMPT = "Hello my name is Robert and I love magic"
NUM_REQUESTS, MAX_TOKENS = 3, 5
EXPECTED_FAMILIES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:iteration_tokens_total",
    "vllm:cache_config_info", "vllm:request_success_total",
    *(f"vllm:{name}_{suffix}"
      for name in ("request_prompt_tokens", "request_generation_tokens", "request_params_n",
                   "request_params_max_tokens", "time_to_first_token_seconds",
                   "inter_token_latency_seconds", "e2e_request_latency_seconds",
                   "request_queue_time_seconds", "request_inference_time_seconds",
                   "request_prefill_time_seconds", "request_decode_time_seconds",
                   "request_num_preemptions")
      for suffix in ("sum", "bucket", "count")),
]  # fmt: skip


def test_metrics_counts(client, server):
    """test_metrics_counts: after N sequential requests of P prompt tokens and T tokens each,
    the histograms count N (T - 1 inter-token gaps each) and the token sums are N·P and N·T.
    The step histogram counts N·T steps as vLLM's does, but sums the tokens each step computes,
    N·(P + T - 1), where vLLM's sums prompt and sampled tokens, N·(P + T): one more for each
    step that samples after a prompt (pegainfer-bench reads it as tokens computed per step)."""
    prompt_ids = tokenize(server, prompt=PROMPT)[:7]  # under one block of 8: no cache hit
    before = metrics(server.url)
    for _ in range(NUM_REQUESTS):
        client.completions.create(model=server.model, prompt=prompt_ids, max_tokens=MAX_TOKENS,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    after = metrics(server.url)
    n, p, t = NUM_REQUESTS, len(prompt_ids), MAX_TOKENS
    expected = {
        "vllm:time_to_first_token_seconds_count": n,
        "vllm:inter_token_latency_seconds_count": n * (t - 1),
        "vllm:e2e_request_latency_seconds_count": n,
        "vllm:request_queue_time_seconds_count": n,
        "vllm:request_inference_time_seconds_count": n,
        "vllm:request_prefill_time_seconds_count": n,
        "vllm:request_decode_time_seconds_count": n,
        "vllm:request_num_preemptions_count": n,
        "vllm:request_num_preemptions_sum": 0,
        "vllm:request_prompt_tokens_sum": n * p,
        "vllm:request_prompt_tokens_count": n,
        "vllm:request_generation_tokens_sum": n * t,
        "vllm:request_generation_tokens_count": n,
        "vllm:request_params_n_count": n,
        "vllm:request_params_max_tokens_sum": n * t,
        "vllm:request_params_max_tokens_count": n,
        "vllm:iteration_tokens_total_sum": n * (p + t - 1),
        "vllm:iteration_tokens_total_count": n * t,
        "vllm:prompt_tokens_total": n * p,
        "vllm:generation_tokens_total": n * t,
    }
    moved = {name: metric(after, name) - metric(before, name) for name in expected}
    assert moved == expected
    success = sum(after[key] - before.get(key, 0.0) for key in after
                  if key[0] == "vllm:request_success_total")  # fmt: skip
    assert success == n


def test_metrics_exist(client, server):
    """test_metrics_exist: every family is served; cache_config_info carries the KV cache's
    size in tokens and its concurrency."""
    client.completions.create(model=server.model, prompt="Hello, my name is", max_tokens=5)
    text = httpx.get(server.url + "/metrics", timeout=30).text
    missing = [name for name in EXPECTED_FAMILIES if name not in text]
    assert not missing
    samples = [sample for family in text_string_to_metric_families(text)
               if family.name == "vllm:cache_config_info" for sample in family.samples]  # fmt: skip
    assert samples
    for sample in samples:
        for label in ("kv_cache_size_tokens", "kv_cache_max_concurrency"):
            assert sample.labels.get(label) not in (None, "None", ""), sample.labels


def gauges(server) -> tuple[float, float, float]:
    snapshot = metrics(server.url)
    return (metric(snapshot, "vllm:num_requests_running"),
            metric(snapshot, "vllm:num_requests_waiting"),
            metric(snapshot, "vllm:kv_cache_usage_perc"))  # fmt: skip


def test_abort_metrics_reset(server):
    """test_abort_metrics_reset: requests cancelled mid-generation leave nothing running,
    nothing waiting and no KV cache in use."""
    assert gauges(server) == (0, 0, 0)

    async def start_and_cancel() -> None:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused",
                                      max_retries=0) as client:  # fmt: skip
            tasks = [
                asyncio.create_task(client.completions.create(
                    model=server.model, prompt=PROMPT, max_tokens=500,
                    extra_body={"ignore_eos": True}))
                for _ in range(3)
            ]  # fmt: skip
            while gauges(server)[0] == 0:
                await asyncio.sleep(0.1)
            running, _, usage = gauges(server)
            assert running > 0 and usage > 0
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(asyncio.wait_for(start_and_cancel(), timeout=120))
    wait_until(lambda: gauges(server) == (0, 0, 0), timeout=30, what="gauges back to zero")
