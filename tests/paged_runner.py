"""Drives a model line's forward directly (chunks of named sequences, every row's logits),
and the checks of that forward against transformers that every line's tests share."""

from __future__ import annotations

from typing import ClassVar

import torch

from pegainfer.core.kv.kv_cache import KVCache
from pegainfer.core.loading.model_files import read_config
from pegainfer.core.model import Model, ModelContext
from pegainfer.core.model_line import ModelLine, RuntimeConfig
from pegainfer.core.runner.forward_batch import ForwardBatch

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


def load_model(line: ModelLine, path, block_size: int = BLOCK) -> Model:
    """A line's model from a checkpoint, in float32 on the CPU, ready to step."""
    ctx = ModelContext(path, read_config(path), torch.float32, torch.device("cpu"))
    model = line.build_model(ctx)
    model.init_runtime(
        RuntimeConfig(
            block_size=block_size, max_model_len=512, max_num_batched_tokens=512, max_num_seqs=16
        )
    )
    return model


# Checks of a line's forward against transformers (float32), shared by the model lines' tests.
TOL = 1e-4


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


def random_tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"max |Δlogit| = {diff:.3g} > {TOL}"


def check_chunked_prefill(ours, hf, tokens: list[int], sizes: tuple[int, ...]) -> None:
    """The prompt in chunks of `sizes`, each continuing from what the last one left."""
    runner, start, reference = PagedRunner(ours), 0, hf_logits(hf, tokens)
    for size in sizes:
        assert_close(runner.step({"a": tokens[start : start + size]})["a"],
                     reference[start : start + size])  # fmt: skip
        start += size


def check_token_by_token_decode(ours, hf, tokens: list[int], prefill: int) -> None:
    runner, reference = PagedRunner(ours), hf_logits(hf, tokens)
    assert_close(runner.step({"a": tokens[:prefill]})["a"], reference[:prefill])
    for pos in range(prefill, len(tokens)):
        assert_close(runner.step({"a": [tokens[pos]]})["a"], reference[pos : pos + 1])


def check_mixed_batch(ours, hf, vocab: int) -> None:
    """Fresh prefills of different lengths, a mid-prompt chunk and decodes in one step."""
    lengths = [("p1", 3), ("p2", 21), ("chunk", 30), ("d1", 9), ("d2", 14)]
    seqs = {name: random_tokens(n, i, vocab) for i, (name, n) in enumerate(lengths)}
    refs = {name: hf_logits(hf, tokens) for name, tokens in seqs.items()}
    runner = PagedRunner(ours)
    runner.step({"chunk": seqs["chunk"][:11], "d1": seqs["d1"][:8], "d2": seqs["d2"][:13]})
    out = runner.step({"p1": seqs["p1"], "d1": seqs["d1"][8:9], "chunk": seqs["chunk"][11:30],
                       "p2": seqs["p2"], "d2": seqs["d2"][13:14]})  # fmt: skip
    assert_close(out["p1"], refs["p1"])
    assert_close(out["p2"], refs["p2"])
    assert_close(out["chunk"], refs["chunk"][11:30])
    assert_close(out["d1"], refs["d1"][8:9])
    assert_close(out["d2"], refs["d2"][13:14])


class ForwardMatchesTransformers:
    """The checks every line's forward passes against transformers' logits (float32, ≤ TOL):
    one-chunk prefills of `PREFILL_LENGTHS` (tests/conftest.py parametrises
    `prefill_length` by them), a prompt of `CHUNKED_LENGTH` tokens in chunks of
    `CHUNK_SIZES`, token-by-token decode after `DECODE_PREFILL` tokens, and a mixed batch. A
    line's test class sets `VOCAB`; its module provides the `models` fixture (ours, hf)."""

    VOCAB: ClassVar[int]
    PREFILL_LENGTHS: ClassVar[tuple[int, ...]] = (1, 5, 17, 70)
    CHUNKED_LENGTH: ClassVar[int] = 60
    CHUNK_SIZES: ClassVar[tuple[int, ...]] = (7, 20, 1, 32)
    DECODE_PREFILL: ClassVar[int] = 10

    def test_prefill(self, models, prefill_length):
        ours, hf = models
        tokens = random_tokens(prefill_length, prefill_length, self.VOCAB)
        assert_close(PagedRunner(ours).step({"a": tokens})["a"], hf_logits(hf, tokens))

    def test_chunked_prefill(self, models):
        tokens = random_tokens(self.CHUNKED_LENGTH, 7, self.VOCAB)
        check_chunked_prefill(*models, tokens, self.CHUNK_SIZES)

    def test_token_by_token_decode(self, models):
        tokens = random_tokens(24, 3, self.VOCAB)
        check_token_by_token_decode(*models, tokens, prefill=self.DECODE_PREFILL)

    def test_mixed_batch(self, models):
        check_mixed_batch(*models, self.VOCAB)
