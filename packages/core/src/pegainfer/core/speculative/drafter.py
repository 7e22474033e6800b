"""The drafter contract: given what a step accepted, propose the next k tokens per request.

The engine runs the drafter right after a step's tokens are accepted, for every request that
sampled a token and is still running. Each request's newest token has no KV yet (the next
verify step feeds it first, then its drafts); its blocks hold k positions past it, where a
drafter that runs the target (or a layer with its own cache in the same block tables) writes
while proposing. What it writes there is overwritten by the verify step before anything reads
it. A line provides its drafter through `Model.build_drafter`; core's `SelfDrafter` serves any
attention-only line.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from pegainfer.core.engine.request import Request


@dataclass(frozen=True)
class DraftInputs:
    """The requests to draft for, and for each its newest token, that token's position, and
    its block table."""

    requests: list[Request]
    tokens: list[int]
    positions: list[int]
    block_tables: list[list[int]]

    @classmethod
    def of(cls, requests: list[Request]) -> DraftInputs:
        return cls(requests, [r.token_ids[-1] for r in requests],
                   [r.num_tokens - 1 for r in requests],
                   [r.block_ids for r in requests])  # fmt: skip


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
        """k drafts for each request of `inputs`."""
