"""One rank's step as the engine planned it: the typed message between the engine (which
schedules) and the model runner of every rank (which turns it into a `ForwardBatch`).

It holds host-side lists only, so it pickles cheaply to parallel workers; the runner builds the
device tensors from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from pegainfer.core.runner.forward_batch import DataParallelCounts, ForwardBatch, logits_rows


@dataclass(frozen=True)
class StepPlan:
    """Sequence i feeds `token_chunks[i]` from position `start_positions[i]`, its KV in the
    blocks `block_tables[i]`; `sample_mask[i]`: its last row samples; `every_row[i]`: every
    row of its chunk wants logits (prompt logprobs). Recurrent models: each sequence's state
    slot, the checkpoint slot it restarts from, and where to checkpoint it (tokens into the
    chunk, checkpoint slot). `data_parallel`: every attention rank's share of the step.
    `num_drafts[i]` (speculative decoding): how many of chunk i's last tokens are drafts to
    verify (empty: none anywhere)."""

    token_chunks: list[list[int]]
    start_positions: list[int]
    block_tables: list[list[int]]
    sample_mask: list[bool]
    every_row: list[bool]
    state_slots: list[int] = field(default_factory=list)
    state_restore: list[int | None] = field(default_factory=list)
    state_snapshot: list[tuple[int, int] | None] = field(default_factory=list)
    data_parallel: DataParallelCounts | None = None
    num_drafts: list[int] = field(default_factory=list)

    @classmethod
    def idle(cls, dummy_block: int) -> StepPlan:
        """An idle data-parallel rank's eager step: one token at position 0 of the dummy
        block, sampling nothing."""
        return cls([[0]], [0], [[dummy_block]], [False], [False], [], [None], [None])

    @property
    def num_tokens(self) -> int:
        return sum(len(chunk) for chunk in self.token_chunks)

    @property
    def num_logits_rows(self) -> int:
        lengths = [len(chunk) for chunk in self.token_chunks]
        drafts = self.num_drafts or None
        return len(logits_rows(lengths, self.sample_mask, self.every_row, drafts)[0])

    def with_counts(self, counts: DataParallelCounts) -> StepPlan:
        return replace(self, data_parallel=counts)

    def batch(self, block_size: int, device: torch.device) -> ForwardBatch:
        return ForwardBatch.build(
            self.token_chunks, self.start_positions, self.block_tables, self.sample_mask,
            block_size, device, state_slots=self.state_slots, state_restore=self.state_restore,
            state_snapshot=self.state_snapshot, every_row=self.every_row,
            data_parallel=self.data_parallel, num_drafts=self.num_drafts or None,
        )  # fmt: skip
