"""The flat metadata of one engine step, as every model line's forward pass consumes it.

Tokens of all scheduled sequences are concatenated: sequence `i` owns rows
`query_start_loc_cpu[i]:query_start_loc_cpu[i+1]`, its new tokens sit at positions
`seq_lens[i] - query_lens[i] .. seq_lens[i] - 1`, and its KV lives in the blocks of
`block_tables_cpu[i]`. Prefill chunks and decodes mix freely (a decode is a query of length 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from pegainfer.core.engine.step_plan import StepPlan


#: int64 elements per 16 bytes.
_ALIGN = 2


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ints as an int64 tensor on `device`, without waiting for the device: on CUDA
    through pinned memory and a non-blocking copy (a plain `torch.tensor(..., device=cuda)`
    synchronises the stream, which stalls a launch behind the step still running)."""
    return to_device_array(np.asarray(values, dtype=np.int64), device)


def to_device_array(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """`to_device` for an array already built on the host."""
    tensor = torch.from_numpy(host)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _packed_to_device(
    parts: list[np.ndarray | list[int]], device: torch.device
) -> list[torch.Tensor]:
    """int64 arrays on the device through one host array and one (pinned, asynchronous) copy,
    each starting 16 bytes into it: Triton specializes a kernel on each pointer argument's
    16-byte alignment, so fields packed back to back would compile a kernel once per parity
    pattern of the step's sizes, while requests wait (the warm-up cannot cover them all)."""
    spans, offset = [], 0
    for part in parts:
        spans.append((offset, len(part)))
        offset += -(-len(part) // _ALIGN) * _ALIGN
    host = np.empty(offset, dtype=np.int64)
    for (start, length), part in zip(spans, parts, strict=True):
        host[start : start + length] = part
    packed = to_device_array(host, device)
    return [packed[start : start + length] for start, length in spans]


def token_slots(
    starts: list[int], lengths: list[int], block_tables: list[list[int]], block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """The position and cache slot (block * block_size + offset) of every token of chunks of
    `lengths` tokens from `starts`, flattened. Vectorised: the only Python loop is over the
    chunks, which hand over the slices of their tables that their tokens touch."""
    count = len(lengths)
    if not count:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    start = np.fromiter(starts, np.int64, count)
    length = np.fromiter(lengths, np.int64, count)
    offsets = np.cumsum(length) - length
    positions = np.arange(int(length.sum()), dtype=np.int64) + np.repeat(start - offsets, length)
    first = start // block_size
    last = (start + length - 1) // block_size  # a chunk has at least one token
    touched = [table[a : b + 1] for table, a, b in zip(block_tables, first.tolist(),
                                                       last.tolist(), strict=True)]  # fmt: skip
    spans = last - first + 1
    blocks = np.fromiter(chain.from_iterable(touched), np.int64, int(spans.sum()))
    index = np.repeat(np.cumsum(spans) - spans - first, length) + positions // block_size
    return positions, blocks[index] * block_size + positions % block_size


@dataclass(frozen=True)
class DataParallelCounts:
    """Every data-parallel attention rank's share of one step: the ranks step together (their
    MoE layers exchange tokens, their logits rows are gathered), so each needs the others'
    sizes. A step without counts (KV sizing's profiling step, graph capture) is the same size
    on every rank."""

    tokens: tuple[int, ...]  # each rank's token rows
    rows: tuple[int, ...]  # each rank's logits rows
    #: The decode-graph bucket every rank replays (None: every rank runs eagerly).
    bucket: int | None = None

    @classmethod
    def uniform(cls, tokens: int, rows: int, world: int) -> DataParallelCounts:
        return cls((tokens,) * world, (rows,) * world)


@dataclass(frozen=True)
class Feed:
    """Async scheduling: the rows of a rank's batch whose input is a token the step still in
    flight samples. Those tokens stay on the device and reach every rank as one broadcast of
    `total` ids, this rank's `len(rows)` of them from `start`."""

    rows: tuple[int, ...]
    start: int
    total: int

    def apply(self, batch: ForwardBatch, fed_ids: torch.Tensor) -> None:
        if self.rows:
            rows = to_device(list(self.rows), batch.input_ids.device)
            batch.input_ids[rows] = fed_ids[self.start : self.start + len(self.rows)]


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset, where KV is written
    logits_indices: torch.Tensor  # [S] int64: rows whose next-token logits are wanted
    block_size: int
    # Host-side metadata: attention planning and the torch reference loop over sequences.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]  # KV length of each sequence after this step
    block_tables_cpu: list[list[int]]
    query_start_loc_cpu: torch.Tensor  # [B + 1] int32
    # Models with recurrent layers (empty lists otherwise), per sequence: its state slot; the
    # checkpoint slot its state restarts from (a prefix hit) or None; where in its chunk to
    # checkpoint the state (tokens into the chunk, checkpoint slot) or None. A sequence whose
    # chunk starts at position 0 starts from a zero state.
    state_slots_cpu: list[int] = field(default_factory=list)
    state_restore_cpu: list[int | None] = field(default_factory=list)
    state_snapshot_cpu: list[tuple[int, int] | None] = field(default_factory=list)
    state_slots: torch.Tensor | None = None  # [B] int64 on the device: state_slots_cpu
    # With `every_row` in `build`: which rows of the logits are the sampling rows ([S] int64
    # on the device), and per sequence the first logits row of its chunk (None: last row only).
    sample_rows: torch.Tensor | None = None
    chunk_logits_cpu: list[int | None] = field(default_factory=list)
    data_parallel: DataParallelCounts | None = None

    def parallel_counts(self, world: int) -> DataParallelCounts:
        """This step's data-parallel counts: those rank 0 planned, or (none planned: KV
        sizing's profiling step, graph capture) this batch's size on every rank."""
        if self.data_parallel is not None:
            return self.data_parallel
        return DataParallelCounts.uniform(self.num_tokens, self.logits_indices.shape[0], world)

    @property
    def starts_states(self) -> bool:
        """Whether some sequence's state does not simply continue from its slot this step: it
        starts at position 0, restarts from a checkpoint, or is checkpointed mid-step."""
        if not self.state_slots_cpu:
            return False
        return (
            any(r is not None for r in self.state_restore_cpu)
            or any(s is not None for s in self.state_snapshot_cpu)
            or any(n == q for n, q in zip(self.seq_lens_cpu, self.query_lens_cpu, strict=True))
        )

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def is_decode(self) -> bool:
        """Every sequence feeds exactly one token (what CUDA graphs capture)."""
        return self.num_tokens == self.num_seqs

    @classmethod
    def build(
        cls,
        token_chunks: list[list[int]],
        start_positions: list[int],
        block_tables: list[list[int]],
        sample_mask: list[bool],
        block_size: int,
        device: torch.device,
        state_slots: list[int] | None = None,
        state_restore: list[int | None] | None = None,
        state_snapshot: list[tuple[int, int] | None] | None = None,
        every_row: list[bool] | None = None,
        data_parallel: DataParallelCounts | None = None,
        num_drafts: list[int] | None = None,
    ) -> ForwardBatch:
        """Flatten one step: sequence i feeds `token_chunks[i]` starting at `start_positions[i]`.

        `sample_mask[i]` says whether sequence i wants logits for its last row (a prefill chunk
        that does not reach the end of the prompt does not); `every_row[i]`, whether it wants
        them for every row of its chunk (prompt logprobs). `data_parallel`: every attention
        rank's share of the step (data-parallel attention). `num_drafts[i]` (speculative
        decoding): the last tokens of chunk i that are drafts; its last 1 + num_drafts rows
        sample.
        """
        lengths = [len(chunk) for chunk in token_chunks]
        every = every_row or [False] * len(token_chunks)
        logits_indices, sample_rows, chunk_logits = logits_rows(
            lengths, sample_mask, every, num_drafts
        )
        state_slots = [] if state_slots is None else list(state_slots)
        seq_lens = [start + n for start, n in zip(start_positions, lengths, strict=True)]
        positions, slots = token_slots(start_positions, lengths, block_tables, block_size)
        tokens = len(positions)
        fields = _packed_to_device(
            [np.fromiter(chain.from_iterable(token_chunks), np.int64, tokens), positions, slots,
             logits_indices, state_slots, sample_rows],
            device,
        )  # fmt: skip
        query_start = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=query_start[1:])
        return cls(
            input_ids=fields[0],
            positions=fields[1],
            slot_mapping=fields[2],
            logits_indices=fields[3],
            block_size=block_size,
            query_lens_cpu=lengths,
            seq_lens_cpu=seq_lens,
            block_tables_cpu=block_tables,
            query_start_loc_cpu=torch.from_numpy(query_start),
            state_slots_cpu=state_slots,
            state_restore_cpu=[None] * len(token_chunks)
            if state_restore is None
            else list(state_restore),
            state_snapshot_cpu=[None] * len(token_chunks)
            if state_snapshot is None
            else list(state_snapshot),
            state_slots=fields[4] if state_slots else None,
            sample_rows=fields[5] if any(every) else None,
            chunk_logits_cpu=chunk_logits,
            data_parallel=data_parallel,
        )


def logits_rows(
    lengths: list[int],
    sample_mask: list[bool],
    every_row: list[bool],
    num_drafts: list[int] | None = None,
) -> tuple[list[int], list[int], list[int | None]]:
    """For chunks of `lengths` tokens, flattened: the token rows whose logits are wanted (every
    row of an `every_row` chunk, else the last 1 + `num_drafts` rows of a sampling chunk);
    which of those logits rows sample (empty when no chunk wants every row: then all of them
    do); and each chunk's first logits row when it wants every row (None otherwise)."""
    wanted: list[int] = []
    sampling: list[int] = []
    first_rows: list[int | None] = []
    end = 0
    drafts = num_drafts or [0] * len(lengths)
    for length, sample, all_rows, n in zip(lengths, sample_mask, every_row, drafts, strict=True):
        end += length
        first_rows.append(len(wanted) if all_rows else None)
        if all_rows:
            assert not n, "a chunk that scores its prompt has no drafts"
            wanted.extend(range(end - length, end))
        elif sample:
            wanted.extend(range(end - 1 - n, end))
        if sample:
            sampling.extend(range(len(wanted) - 1 - n, len(wanted)))
    return wanted, sampling if any(every_row) else [], first_rows


@dataclass(frozen=True)
class LogitsRows:
    """Which rows of a step's logits sample and which score prompts (`ForwardBatch`'s
    `sample_rows` and `chunk_logits_cpu`), for a step whose logits are not one batch's:
    data-parallel attention's, every rank's rows in rank order."""

    sample_rows: torch.Tensor | None
    chunk_logits_cpu: list[int | None]

    @classmethod
    def of(cls, plans: list[StepPlan]) -> LogitsRows:
        """The rows of these plans' batches, one after another."""
        lengths = [len(chunk) for plan in plans for chunk in plan.token_chunks]
        sample_mask = [sample for plan in plans for sample in plan.sample_mask]
        every_row = [every for plan in plans for every in plan.every_row]
        _, sampling, first_rows = logits_rows(lengths, sample_mask, every_row)
        sample_rows = torch.tensor(sampling, dtype=torch.int64) if any(every_row) else None
        return cls(sample_rows, first_rows)
