"""The step's side of structured output: the tokens each constrained row's grammar allows,
applied to a batch's logits (the grammars themselves: `structured_output.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pegainfer.core.sampling.structured_output import mask_executor

if TYPE_CHECKING:
    import llguidance


def mask_logits(logits: torch.Tensor, rows: list[int], matchers: list) -> torch.Tensor:
    """Logits [B, V] with the tokens each matcher forbids at `rows` set to -inf (a copy).

    Called while the step's forward runs on the GPU: the masks are computed on the host in
    parallel and reach the device by non-blocking copies, so the host never waits for the
    forward here."""
    bitmask = _bitmask(len(rows), logits)
    mask_executor().unsafe_compute_mask_ptr(
        [(matcher, i) for i, matcher in enumerate(matchers)], bitmask.data_ptr(),
        bitmask.shape[1] * 4, len(rows),
    )  # fmt: skip
    return _apply(logits, rows, bitmask)


def mask_drafted_logits(
    logits: torch.Tensor, spans: list[tuple[llguidance.LLMatcher, int, list[int]]]
) -> torch.Tensor:
    """Logits [B, V] of a verify step (speculative decoding) with each constrained request's
    rows masked (a copy): `spans` holds (its matcher, its first row, its drafts), and row
    first + j is masked by the matcher's state after the first j drafts (the matcher advances
    over them in parallel with the others', then rolls back). Past a draft its grammar
    forbids, the rows stay unmasked: the row before excludes that draft, so it is rejected
    there and they never count."""
    rows = [first + j for _, first, drafts in spans for j in range(len(drafts) + 1)]
    bitmask = _bitmask(len(rows), logits)
    bitmask.fill_(-1)  # every token allowed, where no mask is written
    size, at, drafted, undrafted = bitmask.shape[1] * 4, 0, [], []
    for matcher, _, drafts in spans:
        if drafts:
            drafted.append((matcher, at, list(drafts)))
        else:  # (llguidance's draft walk takes at least one draft)
            undrafted.append((matcher, at))
        at += len(drafts) + 1
    executor = mask_executor()
    if drafted:
        executor.unsafe_compute_mask_ptr_with_draft_token(
            drafted, bitmask.data_ptr(), size, len(rows)
        )
    if undrafted:
        executor.unsafe_compute_mask_ptr(undrafted, bitmask.data_ptr(), size, len(rows))
    return _apply(logits, rows, bitmask)


def _bitmask(rows: int, logits: torch.Tensor) -> torch.Tensor:
    """A host bitmask for `rows` rows of `logits`' vocabulary (pinned for a CUDA copy)."""
    words = (logits.shape[1] + 31) // 32
    return torch.empty(rows, words, dtype=torch.int32, pin_memory=logits.is_cuda)


def _apply(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` with the tokens `bitmask` forbids at `rows` set to -inf (a copy)."""
    vocab = logits.shape[1]
    pinned = logits.is_cuda
    index = torch.tensor(rows, dtype=torch.int64, pin_memory=pinned)
    if pinned:
        bitmask = bitmask.to(logits.device, non_blocking=True)
        index = index.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]
    masked = logits.clone()
    masked[index] = masked[index].masked_fill(~allowed, -torch.inf)
    return masked
