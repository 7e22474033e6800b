"""Drafters for speculative-decoding tests: spoil another drafter's drafts, or draft what the
model will say (read from a run without speculation), so a test chooses how many drafts are
accepted, from none to all, at every draft index."""

from __future__ import annotations

from pegainfer.core.engine.core import EngineCore
from pegainfer.core.engine.messages import EngineRequest
from pegainfer.core.sampling.sampling_params import SamplingParams
from pegainfer.core.speculative.drafter import Drafter, DraftInputs, Drafts


def spoil(tokens: list[list[int]], positions: list[int], vocab: int) -> list[list[int]]:
    """Replace the drafts whose position plus index is 1 mod 3 by another token: rejections
    then fall on every draft index, and some runs of drafts stay whole."""
    return [[(t + 1) % vocab if (position + i) % 3 == 1 else t for i, t in enumerate(row)]
            for row, position in zip(tokens, positions, strict=True)]  # fmt: skip


class SpoilingDrafter(Drafter):
    """Another drafter's drafts, some replaced (`spoil`)."""

    def __init__(self, inner: Drafter, vocab: int) -> None:
        super().__init__(inner.num_tokens)
        self.inner, self.vocab = inner, vocab

    def propose(self, inputs: DraftInputs) -> Drafts:
        drafts = self.inner.propose(inputs)
        positions = [r.num_tokens - 1 for r in inputs.drafted]
        return Drafts(spoil(drafts.tokens, positions, self.vocab), drafts.probs)


class OracleDrafter(Drafter):
    """Drafts the tokens that follow a request's sequence in `sequences` (by request id: the
    prompt and what greedy decoding without speculation gave), spoiled when `vocab` is set."""

    def __init__(self, num_tokens: int, sequences: dict[str, list[int]], vocab: int = 0) -> None:
        super().__init__(num_tokens)
        self.sequences, self.vocab = sequences, vocab

    def propose(self, inputs: DraftInputs) -> Drafts:
        tokens, positions = [], []
        for request in inputs.drafted:
            known = self.sequences[request.request_id][request.num_tokens :]
            tokens.append((known + [0] * self.num_tokens)[: self.num_tokens])
            positions.append(request.num_tokens - 1)
        return Drafts(spoil(tokens, positions, self.vocab) if self.vocab else tokens)


def run_workload(
    engine: EngineCore, workload: list[tuple[str, list[int], SamplingParams, list[int]]]
) -> dict[str, tuple[list[int], str | None]]:
    """Run `workload` (request id, prompt, parameters, EOS ids) to the end: each request's
    tokens and finish reason; the pool is empty afterwards."""
    for rid, prompt, params, eos in workload:
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=prompt, params=params,
                                         eos_token_ids=eos, arrival_time=0.0))  # fmt: skip
    results: dict[str, tuple[list[int], str | None]] = {}
    while engine.has_unfinished_requests:
        for output in engine.step():
            tokens, _ = results.get(output.request_id, ([], None))
            results[output.request_id] = (tokens + output.new_token_ids, output.finish_reason)
    engine.block_manager.check_invariants()
    assert engine.block_manager.usage == 0.0 and not engine.scheduler.running
    return results
