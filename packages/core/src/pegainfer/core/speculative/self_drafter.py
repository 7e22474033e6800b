"""The target drafting for itself: k decode forwards of the model per step, so a greedy
request's drafts are (up to rounding between a decode and a verify forward) exactly what the
verify step computes, and every draft is accepted.

It serves to measure the best case of speculative decoding with random weights (verify-step
time against accepted length; issue 26 item 5), not to serve: each draft costs a full decode
forward. Its decode forwards write the target's KV at the draft positions, which the verify
step rewrites with the same tokens; a model with recurrent state would advance its state, so
it is refused for those.
"""

from __future__ import annotations

import torch

from pegainfer.core.runner.forward_batch import ForwardBatch, to_device
from pegainfer.core.runner.model_runner import ModelRunner
from pegainfer.core.sampling.sampler import (
    SamplingBatch,
    exponential_noise,
    race,
    target_probs,
)
from pegainfer.core.speculative.drafter import Drafter, DraftInputs, Drafts


class SelfDrafter(Drafter):
    def __init__(
        self,
        runner: ModelRunner,
        num_tokens: int,
        vocab_size: int,
        default_generator: torch.Generator,
    ) -> None:
        super().__init__(num_tokens)
        self.runner = runner
        self.vocab_size = vocab_size
        self.default_generator = default_generator

    def propose(self, inputs: DraftInputs) -> Drafts:
        """Greedy requests draft the argmax; sampled ones draw from the model's distribution
        with their own sampling parameters and generator (their drafts' probabilities go to
        rejection sampling)."""
        runner, device = self.runner, self.runner.device
        requests = inputs.drafted
        count = len(requests)
        if not count:
            return Drafts([])
        params = None
        if not all(r.params.greedy for r in requests):
            # One batch of parameters for all k draft rows (penalties without the drafts).
            params = SamplingBatch.from_requests(
                requests, self.vocab_size, self.default_generator, device
            )
        ids = to_device([r.token_ids[-1] for r in requests], device)
        tables = [r.block_ids for r in requests]
        drafted, probs = [], []
        for i in range(self.num_tokens):
            positions = [r.num_tokens - 1 + i for r in requests]
            batch = ForwardBatch.build([[0]] * count, positions, tables, [True] * count,
                                       runner.block_size, device)  # fmt: skip
            batch.input_ids.copy_(ids)
            logits = runner.forward(batch)
            if params is None:
                ids = logits.argmax(dim=-1)
            else:
                dist = target_probs(logits, params)
                ids = race(dist, exponential_noise(dist.shape, params.generators, device))
                probs.append(dist)
            drafted.append(ids)
        tokens = torch.stack(drafted, dim=1).tolist()
        return Drafts(tokens, torch.stack(probs, dim=1) if probs else None)
