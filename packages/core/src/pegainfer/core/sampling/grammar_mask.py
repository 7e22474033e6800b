"""The step's side of structured output: the tokens each constrained row's grammar allows,
applied to a batch's logits (the grammars themselves: `structured_output.py`)."""

from __future__ import annotations

import torch

from pegainfer.core.sampling.structured_output import mask_executor


def mask_logits(logits: torch.Tensor, rows: list[int], matchers: list) -> torch.Tensor:
    """Logits [B, V] with the tokens each matcher forbids at `rows` set to -inf (a copy).

    Called while the step's forward runs on the GPU: the masks are computed on the host in
    parallel and reach the device by non-blocking copies, so the host never waits for the
    forward here."""
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    pinned = logits.is_cuda
    bitmask = torch.empty(len(rows), words, dtype=torch.int32, pin_memory=pinned)
    mask_executor().unsafe_compute_mask_ptr(
        [(matcher, i) for i, matcher in enumerate(matchers)], bitmask.data_ptr(), words * 4,
        len(rows),
    )  # fmt: skip
    index = torch.tensor(rows, dtype=torch.int64, pin_memory=pinned)
    if pinned:
        bitmask = bitmask.to(logits.device, non_blocking=True)
        index = index.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]
    masked = logits.clone()
    masked[index] = masked[index].masked_fill(~allowed, -torch.inf)
    return masked
