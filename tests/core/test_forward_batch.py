"""The step's flat inputs, built vectorised, against a per-token reading of the same plan."""

from __future__ import annotations

import random

import pytest
import torch

from pegainfer.core.attention.paged import PagedIndex
from pegainfer.core.runner.forward_batch import ForwardBatch, token_slots


def _random_plan(rng: random.Random, block_size: int):
    n = rng.randint(1, 7)
    chunks = [[rng.randrange(1000) for _ in range(rng.choice([1, 1, 3, 17, 40]))] for _ in range(n)]
    starts = [rng.choice([0, 1, 15, 16, 33, 100]) for _ in range(n)]
    tables = [
        rng.sample(range(5000), -(-(s + len(c)) // block_size) + rng.randint(0, 2))
        for s, c in zip(starts, chunks, strict=True)
    ]
    return chunks, starts, tables


def test_positions_and_slots_match_a_per_token_reading_of_the_tables():
    rng = random.Random(0)
    for block_size in (1, 4, 16):
        for _ in range(100):
            chunks, starts, tables = _random_plan(rng, block_size)
            batch = ForwardBatch.build(
                chunks, starts, tables, [True] * len(chunks), block_size, torch.device("cpu")
            )
            spans = [range(s, s + len(c)) for s, c in zip(starts, chunks, strict=True)]
            positions = [p for span in spans for p in span]
            slots = [t[p // block_size] * block_size + p % block_size
                     for span, t in zip(spans, tables, strict=True) for p in span]  # fmt: skip
            assert batch.input_ids.tolist() == [token for c in chunks for token in c]
            assert batch.positions.tolist() == positions
            assert batch.slot_mapping.tolist() == slots
            assert batch.query_start_loc_cpu.tolist()[-1] == len(positions)
            assert batch.seq_lens_cpu == [s + len(c) for s, c in zip(starts, chunks, strict=True)]


def test_no_chunks_give_empty_positions_and_slots():
    positions, slots = token_slots([], [], [], 16)
    assert positions.size == 0 and slots.size == 0


def test_paged_index_lists_each_sequences_pages_and_last_page_fill(monkeypatch):
    # CPU stand-in for pinned memory: the index is built the same way.
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    rng = random.Random(1)
    for _ in range(50):
        chunks, starts, tables = _random_plan(rng, 16)
        batch = ForwardBatch.build(chunks, starts, tables, [True] * len(chunks), 16,
                                   torch.device("cpu"))  # fmt: skip
        index = PagedIndex.of(batch, torch.device("cpu"))
        pages = [-(-n // 16) for n in batch.seq_lens_cpu]
        assert index.kv_indptr.tolist() == [sum(pages[:i]) for i in range(len(pages) + 1)]
        assert index.kv_indices.tolist() == [b for t, p in zip(tables, pages, strict=True)
                                             for b in t[:p]]  # fmt: skip
        assert index.last_page_len.tolist() == [
            n - (p - 1) * 16 for n, p in zip(batch.seq_lens_cpu, pages, strict=True)
        ]


@pytest.mark.parametrize("lengths", [[1], [3], [1, 1, 5], [2, 7, 1], [16, 1, 1]])
def test_every_field_starts_on_16_bytes_for_any_step_shape(lengths):
    """Triton specializes kernels on each pointer's 16-byte alignment: fields packed back to
    back at step-dependent offsets would compile kernels while serving."""
    chunks = [[5] * n for n in lengths]
    batch = ForwardBatch.build(chunks, [0] * len(chunks), [[i] for i in range(len(chunks))],
                               [True] * len(chunks), 16, torch.device("cpu"),
                               state_slots=list(range(len(chunks))),
                               every_row=[i == 0 for i in range(len(chunks))])  # fmt: skip
    fields = [batch.input_ids, batch.positions, batch.slot_mapping, batch.logits_indices,
              batch.state_slots, batch.sample_rows]  # fmt: skip
    base = batch.input_ids.data_ptr()
    assert all((f.data_ptr() - base) % 16 == 0 for f in fields)
    assert batch.input_ids.tolist() == [5] * sum(lengths)
    assert batch.state_slots.tolist() == list(range(len(chunks)))
