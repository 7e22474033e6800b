"""Prometheus metrics under the `vllm:*` names that dashboards and autoscalers already use.

The engine loop only reports state (`EngineStats`) and per-request outputs; every interval
(TTFT, inter-token latency, end-to-end) is measured here, on the frontend side, with one clock.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pegainfer.core.engine.messages import EngineStats, RequestTiming, SpecDecodeStats

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)


def _one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for token-count histograms)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return tuple(buckets)
            buckets.append(step * scale)
        scale *= 10


class Metrics:
    """One model's serving metrics in their own registry.

    `max_model_len` bounds the token-count histograms; `cache_info` becomes the labels of
    `vllm:cache_config_info` (block size, number of blocks, cache dtype).
    """

    def __init__(
        self,
        model_name: str,
        max_model_len: int = 1 << 20,
        cache_info: Mapping[str, str] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self._running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self._waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self._kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).")
        self._prompt_tokens = counter("vllm:prompt_tokens_total", "Prompt tokens processed.")
        self._generation_tokens = counter("vllm:generation_tokens_total", "Tokens generated.")
        self._success = counter(
            "vllm:request_success_total", "Finished requests.", ("finished_reason",)
        )
        self._preemptions = counter("vllm:num_preemptions_total", "Preemptions (recompute).")
        self._prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self._prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (either tier)."
        )
        self._host_hits = counter(
            "vllm:external_prefix_cache_hits",
            "Prompt tokens of prefix-cache hits restored from the host tier (--kv-offload).",
        )
        self._ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to the first token.", _LATENCY_BUCKETS
        )
        self._itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS
        )
        self._e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS
        )
        self._queue = histogram(
            "vllm:request_queue_time_seconds", "Arrival to first scheduling.", _LATENCY_BUCKETS
        )
        self._prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "First scheduling to first token.",
            _LATENCY_BUCKETS,
        )
        self._decode = histogram(
            "vllm:request_decode_time_seconds", "First token to last token.", _LATENCY_BUCKETS
        )
        self._inference = histogram(
            "vllm:request_inference_time_seconds",
            "First scheduling to last token.",
            _LATENCY_BUCKETS,
        )
        tokens = _one_two_five(max_model_len)
        self._request_prompt = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of each finished request.", tokens
        )
        self._request_generation = histogram(
            "vllm:request_generation_tokens", "Output tokens of each finished request.", tokens
        )
        self._max_tokens = histogram(
            "vllm:request_params_max_tokens", "max_tokens of each finished request.", tokens
        )
        self._n = histogram("vllm:request_params_n", "n of each request.", _N_BUCKETS)
        self._request_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Preemptions of each finished request.",
            (0, *_one_two_five(100)),
        )
        self._spec_drafts = counter(
            "vllm:spec_decode_num_drafts", "Verify steps of a request with drafts."
        )
        self._spec_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens verified."
        )
        self._spec_accepted = counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        self._spec_accepted_per_pos = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0: the first draft).",
            ("position",),
        )
        self._step_tokens = histogram(
            "vllm:iteration_tokens_total", "Tokens per engine step.", _STEP_TOKEN_BUCKETS
        )
        info = {**(cache_info or {}), "model_name": model_name}
        cache = Gauge(
            "vllm:cache_config_info",
            "Information of the KV cache (labels); the value is 1.",
            sorted(info),
            registry=r,
        )
        cache.labels(**info).set(1)
        self._model = model_name
        self._last = EngineStats(0, 0, 0.0, 0, 0, 0)

    def record_engine_stats(self, stats: EngineStats) -> None:
        m = self._model
        self._running.labels(m).set(stats.num_running)
        self._waiting.labels(m).set(stats.num_waiting)
        self._kv_usage.labels(m).set(stats.kv_cache_usage)
        last = self._last
        self._prefix_queries.labels(m).inc(stats.prefix_cache_queries - last.prefix_cache_queries)
        self._prefix_hits.labels(m).inc(stats.prefix_cache_hits - last.prefix_cache_hits)
        self._host_hits.labels(m).inc(stats.prefix_cache_hits_host - last.prefix_cache_hits_host)
        self._preemptions.labels(m).inc(stats.num_preemptions - last.num_preemptions)
        step_tokens = self._step_tokens.labels(m)
        for tokens in stats.step_tokens:
            step_tokens.observe(tokens)
        if stats.spec_decode is not None:
            self._record_spec_decode(stats.spec_decode, last.spec_decode or SpecDecodeStats())
        self._last = stats

    def _record_spec_decode(self, now: SpecDecodeStats, last: SpecDecodeStats) -> None:
        m = self._model
        self._spec_drafts.labels(m).inc(now.num_drafts - last.num_drafts)
        self._spec_draft_tokens.labels(m).inc(now.num_draft_tokens - last.num_draft_tokens)
        self._spec_accepted.labels(m).inc(now.num_accepted_tokens - last.num_accepted_tokens)
        before = last.accepted_per_pos or [0] * len(now.accepted_per_pos)
        for position, (count, was) in enumerate(zip(now.accepted_per_pos, before, strict=True)):
            self._spec_accepted_per_pos.labels(m, str(position)).inc(count - was)

    def record_tokens(
        self, num_tokens: int, *, first: bool, latency: float, prompt_tokens: int = 0
    ) -> None:
        """New output tokens; `latency` is since arrival (first) or the previous tokens.

        A sequence's first tokens also count its `prompt_tokens` as processed, as vLLM counts
        them: once per sequence the engine ran (each of a request's `n` choices and each prompt
        of a batch is one; a preempted one recomputed is not counted again), and never for one
        that ended before its prompt ran. `usage.prompt_tokens` counts each prompt once."""
        m = self._model
        self._generation_tokens.labels(m).inc(num_tokens)
        if first:
            self._prompt_tokens.labels(m).inc(prompt_tokens)
        (self._ttft if first else self._itl).labels(m).observe(latency)

    def record_request_params(self, n: int) -> None:
        """A new API request asking for `n` choices."""
        self._n.labels(self._model).observe(n)

    def record_finished(
        self,
        finish_reason: str,
        prompt_tokens: int,
        e2e: float,
        *,
        generation_tokens: int = 0,
        max_tokens: int | None = None,
        timing: RequestTiming | None = None,
    ) -> None:
        """A request ended; `timing` is the engine's account of it, when it was scheduled."""
        m = self._model
        self._success.labels(m, finish_reason).inc()
        self._e2e.labels(m).observe(e2e)
        self._request_prompt.labels(m).observe(prompt_tokens)
        self._request_generation.labels(m).observe(generation_tokens)
        if max_tokens is not None:
            self._max_tokens.labels(m).observe(max_tokens)
        if timing is not None:
            self._queue.labels(m).observe(timing.queue)
            self._prefill.labels(m).observe(timing.prefill)
            self._decode.labels(m).observe(timing.decode)
            self._inference.labels(m).observe(timing.inference)
            self._request_preemptions.labels(m).observe(timing.num_preemptions)

    def render(self) -> bytes:
        return generate_latest(self.registry)
