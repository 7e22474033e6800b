"""`pegainfer.LLM`: the offline Python API (batch generation and chat in one call)."""

from __future__ import annotations

import gc
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pegainfer.core.args import EngineArgs
from pegainfer.core.engine.core import EngineCore
from pegainfer.core.engine.frontend import Frontend, RequestStream
from pegainfer.core.sampling.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]


@dataclass
class GenerationResult:
    """One finished request. `stop_reason` is the stop string or stop token id that ended it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None
    num_cached_tokens: int


class LLM:
    """Load a model and generate for batches of prompts with continuous batching.

    >>> llm = LLM("path/to/checkpoint", max_model_len=2048)
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].text
    """

    def __init__(self, model: str, **engine_args: Any) -> None:
        self._engine: EngineCore | None = EngineCore(EngineArgs(model=model, **engine_args))
        self.frontend = Frontend.for_engine(self._engine.config)
        self.tokenizer = self.frontend.tokenizer
        self._ids = itertools.count()

    @property
    def engine(self) -> EngineCore:
        if self._engine is None:
            raise RuntimeError("this LLM is closed")
        return self._engine

    def close(self) -> None:
        """Shut the engine down and give its device memory back (weights, KV cache, graphs),
        so that another engine can be built in this process at the same
        gpu_memory_utilization. Idempotent; the LLM is unusable afterwards."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        cuda = torch.device(engine.config.device).type == "cuda"
        engine.shutdown()
        del engine
        gc.collect()  # the engine's reference cycles (callbacks, threads' targets)
        if cuda:
            torch.cuda.empty_cache()  # the cached blocks, back to the driver for the next one

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation_config.json defaults (what `params=None` uses)."""
        return self.frontend.default_sampling_params()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Generate for each prompt (text or token ids); results come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        encoded = [
            (p if isinstance(p, str) else None, self.frontend.encode_prompt(p)) for p in prompts
        ]
        return self._run(encoded, params)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[GenerationResult]:
        """Generate the next assistant turn of one conversation or of several."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        encoded = [
            (
                None,
                self.frontend.render_chat(
                    list(conversation),  # type: ignore[arg-type]
                    add_generation_prompt=add_generation_prompt,
                    tools=tools,
                    chat_template_kwargs=chat_template_kwargs,
                ),
            )
            for conversation in conversations
        ]
        return self._run(encoded, params)

    def _run(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[GenerationResult]:
        if params is None:
            params = self.get_default_sampling_params()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} sampling params for {len(prompts)} prompts")
        requests = [
            self.frontend.make_request(str(next(self._ids)), token_ids, p)
            for (_, token_ids), p in zip(prompts, per_prompt, strict=True)
        ]
        for request in requests:  # validate all before starting any
            self.engine.check_request(request)
        streams: dict[str, RequestStream] = {}
        for (text, token_ids), request in zip(prompts, requests, strict=True):
            self.engine.add_request(request)
            streams[request.request_id] = RequestStream(
                request.request_id, token_ids, request.params, self.tokenizer, prompt=text
            )
        try:
            while self.engine.has_unfinished_requests:
                for output in self.engine.step():
                    if streams[output.request_id].process(output).abort_engine:
                        self.engine.abort([output.request_id])
        finally:  # interrupted (an exception, Ctrl-C): leave no request behind in the engine
            self.engine.abort([r.request_id for r in requests])
        return [_result(streams[r.request_id]) for r in requests]


def _result(stream: RequestStream) -> GenerationResult:
    assert stream.finish_reason is not None
    return GenerationResult(
        request_id=stream.request_id,
        prompt=stream.prompt,
        prompt_token_ids=stream.prompt_token_ids,
        text=stream.text,
        token_ids=stream.token_ids,
        finish_reason=stream.finish_reason,
        stop_reason=stream.stop_reason,
        num_cached_tokens=stream.num_cached_tokens,
    )
