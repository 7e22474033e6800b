"""/metrics parses as Prometheus text, and its counters move by what each request did."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pegainfer.core.engine.engine_config import EngineConfig
from pegainfer.core.engine.frontend import Frontend
from pegainfer.core.engine.metrics import Metrics
from pegainfer.core.sampling.sampling_params import SamplingParams
from pegainfer.core.text.tokenizer import Tokenizer
from pegainfer.server.engine_client import AsyncEngineClient
from tests.server.helpers import (
    MESSAGES,
    PROMPT,
    metric,
    metrics,
    sse_payloads,
    tokenize,
    wait_until,
)
from tests.server.test_health import SilentEngine

COUNTERS = [
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
]
HISTOGRAMS = [
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_params_n",
    "vllm:request_params_max_tokens",
    "vllm:iteration_tokens_total",
]
GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]


def complete(server, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def deltas(before, after, names) -> dict[str, float]:
    return {name: metric(after, name) - metric(before, name) for name in names}


def test_exposition_parses_and_names_every_metric(server):
    complete(server, PROMPT, 2)  # so that labelled series exist
    response = httpx.get(server.url + "/metrics", timeout=30)
    assert response.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    for name in GAUGES:
        assert families[name].type == "gauge", name
    for name in [*COUNTERS, "vllm:request_success_total"]:
        assert families[name.removesuffix("_total")].type == "counter", name
    for name in HISTOGRAMS:
        assert families[name].type == "histogram", name
    # Every series carries the served model name, as vLLM's do.
    for family in families.values():
        for sample in family.samples:
            assert sample.labels["model_name"] == server.model, sample
    snapshot = metrics(server.url)
    assert 0.0 <= metric(snapshot, "vllm:kv_cache_usage_perc") <= 1.0
    assert metric(snapshot, "vllm:num_requests_running") >= 0
    assert metric(snapshot, "vllm:num_requests_waiting") >= 0


def test_counters_move_by_what_a_request_did(server):
    n = 5
    prompt = f"{uuid.uuid4().hex} {PROMPT}"
    prompt_tokens = len(tokenize(server, prompt=prompt))
    before = metrics(server.url)
    usage = complete(server, prompt, n)["usage"]
    after = metrics(server.url)
    assert usage["prompt_tokens"] == prompt_tokens and usage["completion_tokens"] == n

    assert deltas(before, after, COUNTERS) == {
        "vllm:prompt_tokens_total": prompt_tokens,
        "vllm:generation_tokens_total": n,
        "vllm:prefix_cache_queries_total": prompt_tokens,
        "vllm:prefix_cache_hits_total": 0,
        "vllm:num_preemptions_total": 0,
    }
    assert deltas(before, after, [h + "_count" for h in HISTOGRAMS]) == {
        "vllm:time_to_first_token_seconds_count": 1,
        "vllm:inter_token_latency_seconds_count": n - 1,  # one token per step
        "vllm:e2e_request_latency_seconds_count": 1,
        "vllm:request_queue_time_seconds_count": 1,
        "vllm:request_prefill_time_seconds_count": 1,
        "vllm:request_decode_time_seconds_count": 1,
        "vllm:request_inference_time_seconds_count": 1,
        "vllm:request_prompt_tokens_count": 1,
        "vllm:request_generation_tokens_count": 1,
        "vllm:request_params_n_count": 1,
        "vllm:request_params_max_tokens_count": 1,
        "vllm:iteration_tokens_total_count": n,  # the prompt's step, then n - 1 decode steps
    }
    sums = [
        "vllm:request_prompt_tokens_sum",
        "vllm:request_generation_tokens_sum",
        "vllm:request_params_n_sum",
        "vllm:request_params_max_tokens_sum",
        "vllm:iteration_tokens_total_sum",
    ]
    assert deltas(before, after, sums) == {
        "vllm:request_prompt_tokens_sum": prompt_tokens,
        "vllm:request_generation_tokens_sum": n,
        "vllm:request_params_n_sum": 1,
        "vllm:request_params_max_tokens_sum": n,
        "vllm:iteration_tokens_total_sum": prompt_tokens + n - 1,
    }
    names = [
        f"vllm:request_{p}_time_seconds_sum" for p in ("queue", "prefill", "decode", "inference")
    ]
    phases = deltas(before, after, names)
    queue, prefill, decode, inference = phases.values()
    assert min(queue, prefill, decode) >= 0 and decode > 0
    assert abs(prefill + decode - inference) < 1e-6
    success = {
        reason: metric(after, "vllm:request_success_total", finished_reason=reason)
        - metric(before, "vllm:request_success_total", finished_reason=reason)
        for reason in ("length", "stop", "abort")
    }
    assert success == {"length": 1, "stop": 0, "abort": 0}
    ttft = metric(after, "vllm:time_to_first_token_seconds_sum") - metric(
        before, "vllm:time_to_first_token_seconds_sum"
    )
    e2e = metric(after, "vllm:e2e_request_latency_seconds_sum") - metric(
        before, "vllm:e2e_request_latency_seconds_sum"
    )
    assert 0 < ttft <= e2e < 30


def test_cache_config_info_names_the_kv_cache(server):
    families = {f.name: f for f in text_string_to_metric_families(metrics_text(server))}
    (sample,) = families["vllm:cache_config_info"].samples
    assert sample.value == 1
    assert int(sample.labels["block_size"]) > 0 and int(sample.labels["num_gpu_blocks"]) > 0
    assert sample.labels["cache_dtype"] in ("float32", "bfloat16", "float16")


def metrics_text(server) -> str:
    response = httpx.get(server.url + "/metrics", timeout=30)
    assert response.status_code == 200
    return response.text


def test_prefix_cache_hits_match_cached_tokens(server):
    prompt = f"{uuid.uuid4().hex} It was the best of times, it was the worst of times."
    complete(server, prompt, 1)
    before = metrics(server.url)
    usage = complete(server, prompt, 1)["usage"]
    after = metrics(server.url)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert deltas(before, after, ["vllm:prefix_cache_hits_total"]) == {
        "vllm:prefix_cache_hits_total": cached
    }
    assert deltas(before, after, ["vllm:prefix_cache_queries_total"]) == {
        "vllm:prefix_cache_queries_total": usage["prompt_tokens"]
    }


def test_stop_and_chat_requests_are_counted_by_reason(server):
    whole = complete(server, PROMPT, 12)["choices"][0]["text"]
    before = metrics(server.url)
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stop": whole[-3:]}
    stopped = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    chat = {"messages": MESSAGES, "max_tokens": 3, "ignore_eos": True}
    assert httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).is_success
    after = metrics(server.url)

    def moved(reason: str) -> float:
        return metric(after, "vllm:request_success_total", finished_reason=reason) - metric(
            before, "vllm:request_success_total", finished_reason=reason
        )

    assert (moved("stop"), moved("length")) == (1, 1)
    prompt_total = len(tokenize(server, prompt=PROMPT)) + len(tokenize(server, messages=MESSAGES))
    assert deltas(before, after, ["vllm:prompt_tokens_total"]) == {
        "vllm:prompt_tokens_total": prompt_total
    }
    generated = stopped["usage"]["completion_tokens"] + 3
    assert deltas(before, after, ["vllm:generation_tokens_total"]) == {
        "vllm:generation_tokens_total": generated
    }


def test_gauges_return_to_zero_when_idle(server):
    def idle() -> bool:
        snapshot = metrics(server.url)
        return (
            metric(snapshot, "vllm:num_requests_running") == 0
            and metric(snapshot, "vllm:num_requests_waiting") == 0
            and metric(snapshot, "vllm:kv_cache_usage_perc") == 0.0
        )

    complete(server, PROMPT, 3)
    wait_until(idle, what="idle gauges")


def test_http_requests_count_refusals_before_the_engine(server):
    """A request refused before it reached the engine left no trace in /metrics, so what came
    in did not balance what the engine finished."""

    def count(snapshot, handler: str, status: str, method: str = "POST") -> float:
        return metric(snapshot, "http_requests_total", handler=handler, method=method,
                      status=status)  # fmt: skip

    before = metrics(server.url)
    complete(server, PROMPT, 1)
    httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    httpx.post(server.url + "/v1/chat/completions", content=b"{", timeout=30)
    httpx.get(server.url + "/no/such/route", timeout=30)
    after = metrics(server.url)
    assert count(after, "/v1/completions", "2xx") == count(before, "/v1/completions", "2xx") + 1
    assert count(after, "/v1/completions", "4xx") == count(before, "/v1/completions", "4xx") + 1
    chat = "/v1/chat/completions"
    assert count(after, chat, "4xx") == count(before, chat, "4xx") + 1
    assert count(after, "none", "4xx", "GET") == count(before, "none", "4xx", "GET") + 1


def test_prompt_tokens_count_once_per_sequence_the_engine_ran(server):
    """As vLLM counts them: each sequence's prompt once, when it runs (each of n choices and
    each prompt of a batch is a sequence), while usage counts each prompt once; every sequence
    finishes once, and the HTTP request is one."""
    prompts = [f"{uuid.uuid4().hex} {PROMPT}", f"{uuid.uuid4().hex} and more"]
    lengths = [len(tokenize(server, prompt=p)) for p in prompts]
    n = 3
    before = metrics(server.url)
    body = {"prompt": prompts, "n": n, "max_tokens": 2, "ignore_eos": True}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    chat = {"messages": MESSAGES, "n": 2, "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    streamed = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60)
    assert streamed.status_code == 200, streamed.text
    after = metrics(server.url)
    chat_prompt = len(tokenize(server, messages=MESSAGES))
    assert response.json()["usage"]["prompt_tokens"] == sum(lengths)
    assert sse_payloads(streamed.content)[-1]["usage"]["prompt_tokens"] == chat_prompt
    sequences = n * len(prompts) + 2
    processed = n * sum(lengths) + 2 * chat_prompt
    assert deltas(before, after, ["vllm:prompt_tokens_total", "vllm:request_prompt_tokens_sum",
                                  "vllm:request_prompt_tokens_count"]) == {
        "vllm:prompt_tokens_total": processed,
        "vllm:request_prompt_tokens_sum": processed,
        "vllm:request_prompt_tokens_count": sequences,
    }  # fmt: skip
    finished = sum(
        metric(after, "vllm:request_success_total", finished_reason=reason)
        - metric(before, "vllm:request_success_total", finished_reason=reason)
        for reason in ("stop", "length", "abort", "error")
    )
    assert finished == sequences


def test_a_sequence_ended_before_its_prompt_ran_counts_no_prompt_tokens(tiny_model):
    """It finishes (aborted, with its prompt's length in the histogram), but its prompt was
    never processed: vLLM leaves it out of prompt_tokens_total."""
    model_config = json.loads((tiny_model / "config.json").read_text())
    config = EngineConfig(tiny_model, tiny_model, model_config, "qwen3", "cpu",
                          "float32", 512, 16, 64, model_config["vocab_size"])  # fmt: skip
    frontend = Frontend(tiny_model, Tokenizer.from_dir(tiny_model))
    ids = frontend.tokenizer.encode("never runs", False)

    async def scenario() -> str:
        client = AsyncEngineClient(SilentEngine(config), frontend, Metrics("m"), 4)
        request = frontend.make_request("r", ids, SamplingParams(max_tokens=4))

        async def wait() -> None:
            async for _ in client.generate(request, client.reserve(1)):
                pass

        task = asyncio.create_task(wait())
        await asyncio.sleep(0.05)
        task.cancel()  # the client went away before the engine admitted it
        await asyncio.gather(task, return_exceptions=True)
        client.close()
        return client.metrics.render().decode()

    families = {f.name: f for f in text_string_to_metric_families(asyncio.run(scenario()))}

    def value(family: str, sample: str, **labels: str) -> float:
        found = [s.value for s in families[family].samples
                 if s.name == sample and labels.items() <= s.labels.items()]  # fmt: skip
        return sum(found)

    assert value("vllm:prompt_tokens", "vllm:prompt_tokens_total") == 0
    assert value("vllm:request_success", "vllm:request_success_total", finished_reason="abort") == 1
    assert value("vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == len(ids)
