"""The engine's state for one request: tokens, progress, blocks, and token-level stops."""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from typing import Any

import torch

from pegainfer.core.engine.messages import EngineRequest
from pegainfer.core.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """Token ids so far (prompt then output), how many have KV, and the blocks holding it."""

    def __init__(
        self, msg: EngineRequest, max_tokens: int, generator: torch.Generator | None
    ) -> None:
        self.request_id = msg.request_id
        self.params: SamplingParams = msg.params
        self.cache_salt = msg.cache_salt
        self.arrival_time = msg.arrival_time
        self.num_prompt_tokens = len(msg.prompt_token_ids)
        self.token_ids: list[int] = list(msg.prompt_token_ids)
        self.max_tokens = max_tokens
        self.generator = generator
        eos = () if msg.params.ignore_eos else msg.eos_token_ids
        self.stop_token_ids = frozenset(eos) | frozenset(msg.params.stop_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.slot: int | None = None  # its state slot while running (recurrent layers)
        # Recurrent layers, after a prefix hit: the checkpoint slot its first chunk starts
        # from, and (key, slot) of a checkpoint brought back from the host tier for it.
        self.state_source: int | None = None
        self.loaded_checkpoint: tuple[bytes, int] | None = None
        self.num_pending = 0  # sampled tokens not yet on the host (trailing PENDING ids)
        self.restore: Any = None  # its blocks' copy from the host tier, while in flight
        self.block_hashes: list[bytes] = []
        self.num_sealed_blocks = 0
        self.num_cached_tokens = -1  # set at first admission
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None  # why it ended, when finish_reason is "error"
        self.stop_token_id: int | None = None
        self.grammar: Any = None  # its llguidance matcher, with structured output
        # Speculative decoding: tokens drafted after its last token, verified by its next step,
        # and the drafter's distribution over each ([k, V] on the device; None: drawn
        # deterministically, e.g. greedily).
        self.draft_token_ids: list[int] = []
        self.draft_probs: torch.Tensor | None = None
        # Prompt logprobs by position (1..), until they go out with the first token.
        self.prompt_logprobs: dict[int, Any] | None = (
            {} if msg.params.prompt_logprobs is not None else None
        )

    #: Stands in token_ids for a token sampled by a step still on the GPU (async scheduling).
    PENDING = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are on the host (all but those still being sampled)."""
        return len(self.token_ids) - self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def needs_known_tokens(self) -> bool:
        """Whether sampling its next token needs every earlier one on the host (penalties
        count them, a grammar's mask follows them, a bad word of several tokens matches
        them)."""
        return (
            self.params.has_penalties
            or self.grammar is not None
            or any(len(word) > 1 for word in self.params.bad_words_token_ids)
        )

    def banned_token_ids(self, continuation: Sequence[int] = ()) -> frozenset[int]:
        """Tokens the sampler must not pick next: stops until `min_tokens`, and each bad
        word's last token where the output ends with the rest of the word. `continuation`:
        tokens taken to follow the output (drafts before the row being sampled)."""
        num_output = self.num_output_tokens + len(continuation)
        banned = self.stop_token_ids if num_output < self.params.min_tokens else None
        words = self.params.bad_words_token_ids
        if not words:
            return banned or frozenset()
        output = [*self.token_ids[self.num_prompt_tokens :], *continuation]
        ends = {
            word[-1]
            for word in words
            if len(word) == 1
            or (len(output) >= len(word) - 1 and output[1 - len(word) :] == word[:-1])
        }
        return frozenset(ends) | (banned or frozenset())

    def reserve_token(self) -> None:
        """A step that samples this request's next token was launched; its id comes later."""
        self.token_ids.append(self.PENDING)
        self.num_pending += 1

    def commit_token(self, token_id: int, max_model_len: int) -> None:
        """The oldest pending token's id arrived: record it and decide whether it ends the
        request (counting only tokens up to it, not those sampled after it). Its grammar, if
        any, has consumed the token already (the scheduler advances a batch's together)."""
        index = len(self.token_ids) - self.num_pending
        self.token_ids[index] = token_id
        self.num_pending -= 1
        outputs = index + 1 - self.num_prompt_tokens
        if self.grammar is not None and self.grammar.is_error():
            # The grammar engine gave up (a lexer or parser limit): the output can no longer be
            # held to the constraint, so the request ends with an error, never a quiet "stop".
            self.finish_reason = "error"
            reason = self.grammar.get_error().split("\n", 1)[0]
            self.error = f"the structured output's grammar failed after {outputs} tokens: {reason}"
            if self.params.restricts_tokens:  # (the sampler had no allowed token to pick)
                self.error += "; allowed_token_ids or bad_words may leave no token it allows"
            logger.warning("request %s: %s", self.request_id, self.error)
        elif token_id in self.stop_token_ids and outputs >= self.params.min_tokens:
            self.finish_reason, self.stop_token_id = "stop", token_id
        elif self.grammar is not None and self.grammar.is_stopped():
            self.finish_reason = "stop"  # the grammar allows nothing more
        elif outputs >= self.max_tokens or index + 1 >= max_model_len:
            self.finish_reason = "length"

    def commit_tokens(self, token_ids: Sequence[int], max_model_len: int, consume: bool) -> int:
        """A verify step's accepted tokens (speculative decoding) arrived for its pending
        token: commit them in order until one ends the request; return how many were taken
        (those after the end are dropped, as if never sampled). `consume`: its grammar, if
        any, consumes each before it is committed (else it has consumed them already)."""
        for taken, token_id in enumerate(token_ids, 1):
            if taken > 1:
                self.reserve_token()
            if consume and self.grammar is not None:
                self.grammar.consume_token(token_id)
            self.commit_token(token_id, max_model_len)
            if self.finish_reason is not None:
                return taken
        return len(token_ids)

    def clear_drafts(self) -> None:
        self.draft_token_ids = []
        self.draft_probs = None

    def at_limit(self, max_model_len: int) -> bool:
        """Whether the tokens sampled so far (pending ones too) already end the request by
        length, so no further step should be scheduled for it."""
        return self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len
