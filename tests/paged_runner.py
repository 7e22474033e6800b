"""Drives a model line's forward directly: chunks of named sequences, every row's logits."""

from __future__ import annotations

import torch

from pegainfer.core.forward_batch import ForwardBatch
from pegainfer.core.kv_cache import KVCache

BLOCK = 4


class PagedRunner:
    """Feeds chunks of several sequences through a model (paged KV, a state slot each)."""

    def __init__(
        self, model, num_blocks: int = 64, num_slots: int = 8, device: str = "cpu"
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.kv = KVCache(
            model.kv_arenas(BLOCK), num_blocks, self.device, model.state_arenas(), num_slots
        )
        # Hand out blocks and slots in a scrambled order so contiguity cannot hide table bugs.
        self.free = list(torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)))
        self.free_slots = list(
            torch.randperm(num_slots, generator=torch.Generator().manual_seed(2))
        )
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}
        self.slots: dict[str, int] = {}

    def step(self, chunks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        starts = []
        for name, chunk in chunks.items():
            table = self.tables.setdefault(name, [])
            start = self.lengths.get(name, 0)
            while len(table) * BLOCK < start + len(chunk):
                table.append(int(self.free.pop()))
            starts.append(start)
            self.lengths[name] = start + len(chunk)
            if name not in self.slots:
                self.slots[name] = int(self.free_slots.pop())
        batch = ForwardBatch.build(
            token_chunks=list(chunks.values()),
            start_positions=starts,
            block_tables=[self.tables[n] for n in chunks],
            sample_mask=[True] * len(chunks),
            block_size=BLOCK,
            device=self.device,
            state_slots=[self.slots[n] for n in chunks],
        )
        batch.logits_indices = torch.arange(batch.num_tokens, device=self.device)
        self.model.prepare(batch)
        with torch.inference_mode():
            logits = self.model(batch, self.kv)
        out, row = {}, 0
        for name, chunk in chunks.items():
            out[name] = logits[row : row + len(chunk)]
            row += len(chunk)
        return out
