"""`StagedCopies`' runs of rows through its two buffers (plain memory on the CPU: the chunking,
strides and dtype conversion; the GPU test copies to a device through page-locked ones)."""

from __future__ import annotations

import pytest
import torch

from pegainfer.core.loading.staging import StagedCopies

CPU = torch.device("cpu")


def sources() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(40, 24, generator=g)
    return {
        "contiguous": base,
        "columns": base[:, 5:17],  # strided rows
        "transposed": base.t(),
        "3-d": torch.randn(9, 4, 6, generator=g),
        "1-d": torch.randn(333, generator=g),
        "bf16": base.bfloat16(),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 8),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(sources()))
def test_staged_copies_equal_a_plain_copy(name, dtype):
    src = sources()[name]
    want = torch.empty(src.shape, dtype=dtype).copy_(src)
    dst = torch.full(src.shape, float("nan"), dtype=dtype)
    # 256 bytes: a few rows a run, and the 3-d tensor's 96-byte rows two at a time.
    with StagedCopies(CPU, buffer_bytes=256, page_locked=False) as staging:
        staging.copy(dst, src)
    assert torch.equal(dst, want)


def test_rows_wider_than_a_buffer_and_mismatched_shapes():
    src = torch.randn(3, 100)
    dst = torch.empty(3, 100)
    with StagedCopies(CPU, buffer_bytes=64, page_locked=False) as staging:
        staging.copy(dst, src)  # 400-byte rows: copied directly
        with pytest.raises(ValueError, match="cannot copy a"):
            staging.copy(torch.empty(3, 99), src)
    assert torch.equal(dst, src)
