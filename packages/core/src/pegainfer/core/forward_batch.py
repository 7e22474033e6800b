"""The flat metadata of one engine step, as every model line's forward pass consumes it.

Tokens of all scheduled sequences are concatenated: sequence `i` owns rows
`query_start_loc[i]:query_start_loc[i+1]`, its new tokens sit at positions
`seq_lens[i] - query_lens[i] .. seq_lens[i] - 1`, and its KV lives in the blocks of
`block_tables[i]`. Prefill chunks and decodes mix freely (a decode is a query of length 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset, where KV is written
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32: KV length after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    logits_indices: torch.Tensor  # [S] int64: rows whose next-token logits are wanted
    block_size: int
    # Host copies for code that loops over sequences (the torch reference path).
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @classmethod
    def build(
        cls,
        token_chunks: list[list[int]],
        start_positions: list[int],
        block_tables: list[list[int]],
        sample_mask: list[bool],
        block_size: int,
        device: torch.device,
    ) -> ForwardBatch:
        """Flatten one step: sequence i feeds `token_chunks[i]` starting at `start_positions[i]`.

        `sample_mask[i]` says whether sequence i wants logits for its last row (a prefill chunk
        that does not reach the end of the prompt does not).
        """
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        for chunk, start, table, sample in zip(
            token_chunks, start_positions, block_tables, sample_mask, strict=True
        ):
            input_ids.extend(chunk)
            for pos in range(start, start + len(chunk)):
                positions.append(pos)
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            query_start.append(query_start[-1] + len(chunk))
            seq_lens.append(start + len(chunk))
            if sample:
                logits_indices.append(query_start[-1] - 1)
        width = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in block_tables]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            input_ids=tensor(input_ids, torch.int64),
            positions=tensor(positions, torch.int64),
            slot_mapping=tensor(slots, torch.int64),
            query_start_loc=tensor(query_start, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            block_tables=tensor(padded, torch.int32).reshape(len(padded), width),
            logits_indices=tensor(logits_indices, torch.int64),
            block_size=block_size,
            query_lens_cpu=[len(c) for c in token_chunks],
            seq_lens_cpu=seq_lens,
        )
