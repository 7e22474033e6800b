"""The drafter contract: given what a step accepted, propose the next k tokens per request.

The engine runs the drafter right after a step's tokens are accepted and committed. It sees
every chunk of the step whose request still runs, with the rows of it that stand (a drafter
with a cache of its own, an MTP layer's, fills it for them from the target's hidden states),
and proposes for those that sampled a token. Such a request's newest token has no KV yet (the
next verify step feeds it first, then its drafts); its blocks hold k positions past it, where
a drafter writes while proposing. What it writes there is overwritten before anything reads
it. A line provides its drafter through `Model.build_drafter`; core's `SelfDrafter` serves any
attention-only line.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from pegainfer.core.engine.request import Request, RequestStatus
from pegainfer.core.engine.scheduler import ScheduledChunk
from pegainfer.core.runner.forward_batch import ForwardBatch


@dataclass(frozen=True)
class DraftInputs:
    """The step just verified, for each chunk whose request still runs: the request, the
    position of the chunk's first token, the chunk's first row in the step's batch, how many
    of its rows stand (all of a chunk that did not sample; of one that did, its last token's
    and its accepted drafts'), and whether to draft for it (it sampled)."""

    requests: list[Request]
    starts: list[int]
    first_rows: list[int]
    kept: list[int]
    drafting: list[bool]

    @classmethod
    def of(
        cls, chunks: list[ScheduledChunk], batch: ForwardBatch, accepted: dict[int, int]
    ) -> DraftInputs:
        """`chunks`: the step's, as `batch` holds them; `accepted`: the drafts each sampling
        chunk's request kept, by the request's id."""
        inputs = cls([], [], [], [], [])
        for i, chunk in enumerate(chunks):
            request = chunk.request
            if request.status is not RequestStatus.RUNNING:
                continue
            inputs.requests.append(request)
            inputs.starts.append(batch.seq_lens_cpu[i] - batch.query_lens_cpu[i])
            inputs.first_rows.append(int(batch.query_start_loc_cpu[i]))
            kept = chunk.num_tokens
            if chunk.samples:
                kept -= chunk.num_drafts - accepted[id(request)]
            inputs.kept.append(kept)
            inputs.drafting.append(chunk.samples)
        return inputs

    @property
    def drafted(self) -> list[Request]:
        """The requests to draft for, in order."""
        return [r for r, draft in zip(self.requests, self.drafting, strict=True) if draft]


@dataclass(frozen=True)
class Drafts:
    """`tokens[i]`: request i's k drafts; `probs` [S, k, V] (on the device): the distribution
    each was drawn from, for rejection sampling; None when every draft was chosen
    deterministically (greedily: one-hot)."""

    tokens: list[list[int]]
    probs: torch.Tensor | None = None

    def assign(self, requests: list[Request]) -> None:
        """Hand each request its drafts for its next step."""
        for i, request in enumerate(requests):
            request.draft_token_ids = self.tokens[i]
            request.draft_probs = None if self.probs is None else self.probs[i]


class Drafter(ABC):
    """Proposes `num_tokens` tokens per request (`--speculative-tokens`)."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens

    @abstractmethod
    def propose(self, inputs: DraftInputs) -> Drafts:
        """k drafts for each of `inputs.drafted`, in order (it may be empty: a step of prompt
        chunks that do not sample, for a drafter that fills a cache of its own)."""
