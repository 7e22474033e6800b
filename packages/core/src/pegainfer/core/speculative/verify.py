"""The verify side of a speculative step: each sampling request's 1 + n logits rows become its
accepted drafts and the token after them, with the counts vLLM's `spec_decode` metrics report.
A request with structured output has each row masked by its grammar's state after the drafts
before the row, so only tokens its grammar allows are accepted or drawn."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pegainfer.core.engine.messages import SpecDecodeStats
from pegainfer.core.engine.request import Request
from pegainfer.core.engine.scheduler import ScheduledChunk
from pegainfer.core.runner.forward_batch import to_device
from pegainfer.core.sampling.grammar_mask import mask_drafted_logits
from pegainfer.core.sampling.sampler import (
    SamplingBatch,
    ScoredTokens,
    exponential_noise,
    plain_greedy,
    target_probs,
)
from pegainfer.core.speculative.acceptance import Verified, greedy_accept, rejection_sample
from pegainfer.core.speculative.drafter import Drafter


@dataclass(frozen=True)
class _Rows:
    """Where each sampling request's rows sit among the step's sampling rows."""

    requests: list[Request]
    num_drafts: list[int]
    offsets: list[int]

    @classmethod
    def of(cls, chunks: list[ScheduledChunk]) -> _Rows:
        counts = [chunk.num_drafts for chunk in chunks]
        offsets, row = [], 0
        for n in counts:
            offsets.append(row)
            row += n + 1
        return cls([chunk.request for chunk in chunks], counts, offsets)

    @property
    def width(self) -> int:
        return max(self.num_drafts, default=0)

    def drafts(self, i: int) -> list[int]:
        return self.requests[i].draft_token_ids[: self.num_drafts[i]]

    def flat(self, i: int) -> list[int]:
        """Request i's rows."""
        return list(range(self.offsets[i], self.offsets[i] + self.num_drafts[i] + 1))

    def padded(self, device: torch.device) -> torch.Tensor:
        """[S, K + 1] row indices, each request's last row repeated past its own."""
        width = self.width + 1
        rows = [self.offsets[i] + min(j, n) for i, n in enumerate(self.num_drafts)
                for j in range(width)]  # fmt: skip
        return to_device(rows, device).view(-1, width)


class SpeculativeDecoding:
    """Verifies drafts against the target's logits and hands out the next drafts."""

    def __init__(
        self, drafter: Drafter, vocab_size: int, default_generator: torch.Generator
    ) -> None:
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.default_generator = default_generator
        self.counters = SpecDecodeStats(accepted_per_pos=[0] * drafter.num_tokens)

    def verify(
        self, logits: torch.Tensor, chunks: list[ScheduledChunk]
    ) -> tuple[Verified, list[tuple[int, ScoredTokens]]]:
        """`logits`: the step's sampling rows, each chunk's 1 + num_drafts in order. Returns
        the verified tokens and, for each request that asks for logprobs, (its index, the
        scores of its rows' tokens)."""
        rows = _Rows.of(chunks)
        device = logits.device
        scored = logits  # logprobs are the model's own, before any mask (as vLLM's)
        constrained = [(r.grammar, rows.offsets[i], rows.drafts(i))
                       for i, r in enumerate(rows.requests)
                       if r.grammar is not None and not r.grammar.is_error()]  # fmt: skip
        if constrained:
            logits = mask_drafted_logits(logits, constrained)
        width = rows.width
        drafts = to_device([d for i in range(len(chunks))
                            for d in (rows.drafts(i) + [-1] * width)[:width]],
                           device).view(len(chunks), width)  # fmt: skip
        num_drafts = to_device(rows.num_drafts, device)
        index = rows.padded(device)
        row_requests = [r for i, r in enumerate(rows.requests) for _ in rows.flat(i)]
        continuations = [rows.drafts(i)[:j] for i in range(len(chunks))
                         for j in range(rows.num_drafts[i] + 1)]  # fmt: skip
        if all(plain_greedy(r, c) for r, c in zip(row_requests, continuations, strict=True)):
            verified = greedy_accept(logits.argmax(dim=-1)[index], drafts, num_drafts)
        else:
            batch = SamplingBatch.from_requests(
                row_requests, self.vocab_size, self.default_generator, device, continuations
            )
            probs = target_probs(logits, batch)
            uniform = torch.stack([torch.rand(width, generator=g, device=device)
                                   for g in self._generators(rows)])  # fmt: skip
            noise = exponential_noise(probs.shape, batch.generators, device)
            verified = rejection_sample(probs[index], drafts, self._draft_probs(rows, drafts),
                                        num_drafts, uniform, noise[index])  # fmt: skip
        return verified, self._scores(scored, rows, verified)

    def _generators(self, rows: _Rows) -> list[torch.Generator]:
        return [r.generator or self.default_generator for r in rows.requests]

    def _draft_probs(self, rows: _Rows, drafts: torch.Tensor) -> torch.Tensor | None:
        """[S, K, V] the drafter's distributions (one-hot where a request's drafts were chosen
        deterministically); None when all were."""
        if all(r.draft_probs is None for r in rows.requests):
            return None
        count, width = drafts.shape
        probs = torch.zeros(count, width, self.vocab_size, device=drafts.device)
        for i, request in enumerate(rows.requests):
            n = rows.num_drafts[i]
            if request.draft_probs is not None:
                probs[i, :n] = request.draft_probs[:n]
            elif n:
                probs[i, torch.arange(n, device=drafts.device), drafts[i, :n]] = 1.0
        return probs

    @staticmethod
    def _scores(
        logits: torch.Tensor, rows: _Rows, verified: Verified
    ) -> list[tuple[int, ScoredTokens]]:
        """Logprobs of every row's token (the commit keeps the accepted ones')."""
        scored = []
        for i, request in enumerate(rows.requests):
            if request.params.logprobs is None:
                continue
            flat = to_device(rows.flat(i), logits.device)
            tokens = verified.tokens[i, : rows.num_drafts[i] + 1]
            count = request.params.logprobs or 0
            scored.append((i, ScoredTokens.of(logits, flat, tokens, [count] * len(rows.flat(i)))))
        return scored

    def snapshot(self) -> SpecDecodeStats:
        """The counts so far, as a copy (they go on counting)."""
        c = self.counters
        return SpecDecodeStats(
            c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, list(c.accepted_per_pos)
        )

    def record(self, chunks: list[ScheduledChunk], runs: list[list[int]]) -> None:
        """Count the step's drafts and how many were accepted, by position."""
        counters = self.counters
        for chunk, run in zip(chunks, runs, strict=True):
            if not chunk.num_drafts:
                continue
            accepted = len(run) - 1
            counters.num_drafts += 1
            counters.num_draft_tokens += chunk.num_drafts
            counters.num_accepted_tokens += accepted
            for position in range(accepted):
                counters.accepted_per_pos[position] += 1
