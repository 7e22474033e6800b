"""The request side of the engine boundary, shared by the offline API and the HTTP server.

`Frontend` turns prompts and chats into `EngineRequest`s and `RequestLimits` validates them
against the served model without an engine (the HTTP server never holds one: the engine
may run in another process); `RequestStream` turns the engine's token-id outputs for one
request back into text, applying stop strings (which the engine cannot see). None of them
runs on the engine loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pegainfer.core.engine.messages import EngineRequest, RequestOutput, TokenLogprob
from pegainfer.core.errors import InvalidRequestError
from pegainfer.core.loading.generation_config import GenerationDefaults
from pegainfer.core.plugins import find_model_line
from pegainfer.core.process_info import release_freed_memory
from pegainfer.core.sampling.sampling_params import SamplingParams
from pegainfer.core.sampling.structured_output import StructuredOutput
from pegainfer.core.text.detokenizer import IncrementalDetokenizer
from pegainfer.core.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pegainfer.core.engine.engine_config import EngineConfig
    from pegainfer.core.engine.model_source import ModelSource
    from pegainfer.core.model_line import ModelLine

logger = logging.getLogger(__name__)


@dataclass
class StreamDelta:
    """What one engine output added to a request, in text and tokens."""

    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # Set when a stop string ended the request but the engine does not know yet.
    abort_engine: bool = False
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of `token_ids`, if asked
    prompt_logprobs: list[TokenLogprob] | None = None  # with the first token, if asked

    def extend(self, later: StreamDelta) -> None:
        """Fold the delta that followed this one in, so two deltas go out as one event."""
        self.text += later.text
        self.token_ids += later.token_ids
        self.logprobs = self.logprobs + later.logprobs
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.abort_engine = self.abort_engine or later.abort_engine
        self.finished, self.finish_reason = later.finished, later.finish_reason
        self.stop_reason = later.stop_reason


@dataclass(frozen=True)
class RequestLimits:
    """What a request must satisfy to be served by a model: the checks the engine makes on
    every request it accepts, made by the frontend too so a bad request is refused before
    it is sent (and before a stream's status line)."""

    vocab_size: int
    max_model_len: int
    #: The server's: compiles a grammar against the tokenizer and computes its first mask
    #: (some grammars fail only there), raising `InvalidRequestError`, so every bad one is a
    #: 400 (the engine does it: `AsyncEngineClient.check_grammar`). Without it a grammar is
    #: checked without the tokenizer (`StructuredOutput.validate`).
    check_grammar: Callable[[StructuredOutput, list[int]], None] | None = None

    def check(self, msg: EngineRequest) -> int:
        """Raise `InvalidRequestError` naming the first problem; return the resolved
        max_tokens."""
        prompt = msg.prompt_token_ids
        if not prompt:
            raise InvalidRequestError("the prompt must contain at least one token", "prompt")
        vocab = self.vocab_size
        outside = [token for token in prompt if not 0 <= token < vocab]
        if outside:
            raise InvalidRequestError(
                f"prompt token ids {outside[:5]} are out of vocabulary [0, {vocab})", "prompt"
            )
        msg.params.validate(vocab)
        if msg.params.structured is not None and self.check_grammar is not None:
            self.check_grammar(msg.params.structured, msg.eos_token_ids)
        elif msg.params.structured is not None:
            msg.params.structured.validate()
        self.check_prompt_length(len(prompt))
        limit = self.max_model_len
        max_tokens = msg.params.max_tokens or limit - len(prompt)
        if len(prompt) + max_tokens > limit:
            raise InvalidRequestError(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                f"model's context of {limit} tokens",
                "max_tokens",
            )
        return max_tokens

    def check_prompt_length(self, num_tokens: int, *, at_least: bool = False) -> None:
        """Refuse a prompt of `num_tokens` tokens (`at_least`: a lower bound on them, known
        before tokenizing) that leaves no room to generate."""
        limit = self.max_model_len
        if num_tokens >= limit:
            raise InvalidRequestError(
                f"the prompt has {'at least ' if at_least else ''}{num_tokens} tokens, but this "
                f"model's context is {limit} tokens and at least one must be left to generate",
                "prompt",
            )


@dataclass
class RequestStream:
    """Frontend state of one request: incremental text, stop strings, final accounting."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tokenizer: Tokenizer
    prompt: str | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of `token_ids`, if asked
    prompt_logprobs: list[TokenLogprob] | None = None  # of the prompt's tokens after its first

    def __post_init__(self) -> None:
        self._detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            self.prompt_token_ids,
            skip_special_tokens=self.params.skip_special_tokens,
            stop=self.params.stop,
            min_tokens=self.params.min_tokens,
            include_stop=self.params.include_stop_str_in_output,
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, output: RequestOutput) -> StreamDelta:
        """Fold one engine output in; after the request finished, outputs are ignored."""
        if self.finished:
            return StreamDelta("", [], finished=True)
        self.num_cached_tokens = output.num_cached_tokens
        new_ids, logprobs = output.new_token_ids, output.logprobs or []
        text_ids = new_ids
        if output.stop_token_id is not None:  # as vLLM: the stop token counts, its text does not
            text_ids = text_ids[:-1]
        decoded = self._detokenizer.push(text_ids)
        if decoded.finished:
            # Tokens after the one that completed a stop string (several come at once with
            # speculative decoding) were never part of the output.
            new_ids, logprobs = new_ids[: decoded.num_tokens], logprobs[: decoded.num_tokens]
        self.token_ids.extend(new_ids)
        text = decoded.text
        delta = StreamDelta(text, list(new_ids), logprobs=logprobs,
                            prompt_logprobs=output.prompt_logprobs)  # fmt: skip
        self.logprobs.extend(delta.logprobs)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        if decoded.finished:
            self.finish_reason, self.stop_reason = "stop", self._detokenizer.stop_reason
            delta.abort_engine = not output.finished
        elif output.finished:
            delta.text += self._detokenizer.flush()
            if self._detokenizer.stop_reason is not None:  # the flushed tail ended in a stop
                self.finish_reason, self.stop_reason = "stop", self._detokenizer.stop_reason
            else:
                self.finish_reason, self.stop_reason = output.finish_reason, output.stop_token_id
        self.text += delta.text
        delta.finished = self.finished
        delta.finish_reason, delta.stop_reason = self.finish_reason, self.stop_reason
        return delta


class Frontend:
    """Tokenizer, chat template and generation defaults of one served model."""

    def __init__(self, model_dir: Path, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.defaults = GenerationDefaults.from_dir(model_dir, tokenizer.eos_token_id)

    @classmethod
    def for_engine(cls, config: EngineConfig, lines: list[ModelLine] | None = None) -> Frontend:
        """The frontend of the model an engine serves, its tokenizer loaded by the engine's
        model line (found among `lines`, default the installed ones)."""
        return cls.load(find_model_line(config.line, lines), config.model_dir, config.tokenizer_dir)

    @classmethod
    def for_source(cls, source: ModelSource) -> Frontend:
        """The frontend of the model `source` names (before an engine has loaded it)."""
        return cls.load(source.line, source.model_dir, source.tokenizer_dir)

    @classmethod
    def load(cls, line: ModelLine, model_dir: Path, tokenizer_dir: Path) -> Frontend:
        frontend = cls(model_dir, line.load_tokenizer(tokenizer_dir))
        release_freed_memory()  # parsing Qwen3's tokenizer.json leaves ~90 MB of freed heap
        return frontend

    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        return self.defaults.sampling_params(**overrides)

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Render a conversation with the model's chat template and tokenize it (the
        arguments are `chat_prompt`'s)."""
        text = self.chat_prompt(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            continue_final_message=continue_final_message,
        )
        # The template writes any special tokens itself.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """A conversation rendered with the model's chat template: text to encode without
        special tokens (the template writes its own).

        `continue_final_message` leaves the last message open (vLLM's option): the prompt
        ends right after its content, so the model continues it instead of answering it.
        """
        extra = dict(chat_template_kwargs or {})
        clashes = sorted(extra.keys() & {"messages", "tools", "add_generation_prompt"})
        if clashes:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(clashes)}: they are request fields",
                "chat_template_kwargs",
            )
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message needs add_generation_prompt false", "continue_final_message"
            )
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **extra
        )
        if continue_final_message:
            text = _open_final_message(text, messages[-1].get("content"))
        return text

    def make_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> EngineRequest:
        return EngineRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            params=params,
            eos_token_ids=list(self.defaults.eos_token_ids),
            arrival_time=time.time(),
        )


def _open_final_message(rendered: str, content: Any) -> str:
    """`rendered` cut right after the last message's content (what the template wrote after
    it closes the turn)."""
    if not isinstance(content, str) or not content.strip():
        raise InvalidRequestError(
            "continue_final_message needs a last message with text to continue",
            "continue_final_message",
        )
    for piece in (content, content.rstrip()):
        end = rendered.rfind(piece)
        if end >= 0:
            return rendered[: end + len(piece)]
    raise InvalidRequestError(
        "the chat template does not write the last message's content as given, so it cannot "
        "be continued",
        "continue_final_message",
    )
