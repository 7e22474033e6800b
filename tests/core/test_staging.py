"""The checkpoint's bytes into parameters (`safetensors_index`, `CheckpointCopies`), on the CPU
through plain buffers: each tensor's bytes as safetensors reads them, for every dtype, for
selections of rows and columns, in runs through buffers smaller than a tensor or a row; and
every line's tiny checkpoint (sharded, FP8 with block scales, INT4 groups, a tensor-parallel
rank's share) loads byte for byte as a plain loader reading through safetensors does. The GPU
test copies through page-locked buffers on a side stream (`test_staging_gpu.py`)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pegainfer.core.distributed.parallel import ParallelGroup
from pegainfer.core.errors import WeightLoadError
from pegainfer.core.loading import weights as weights_module
from pegainfer.core.loading.model_files import read_config
from pegainfer.core.loading.safetensors_index import DTYPES, StoredTensor, read_index
from pegainfer.core.loading.staging import CheckpointCopies
from pegainfer.core.model import ModelContext
from pegainfer.core.model_line import ModelLine
from pegainfer.core.process_info import rss_bytes

CPU = torch.device("cpu")


def random_tensors() -> dict[str, torch.Tensor]:
    """A tensor of every dtype safetensors and torch share, and shapes that stress the runs."""
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, dtype in DTYPES.items():
        bits = torch.randint(0, 256, (37 * 5 * dtype.itemsize,), dtype=torch.uint8, generator=g)
        tensor = bits.view(dtype).view(37, 5)
        if dtype == torch.bool:  # only 0 and 1 are booleans
            tensor = (bits[: 37 * 5] % 2).bool().view(37, 5)
        elif dtype.is_floating_point:  # no NaN: compared with torch.equal below
            tensor = torch.nan_to_num(tensor.float()).clamp(-100, 100).to(dtype)
        tensors[f"t.{name.lower()}"] = tensor
    tensors["wide"] = torch.randn(3, 300, generator=g)  # 1200-byte rows
    tensors["3d"] = torch.randn(9, 4, 6, generator=g)
    tensors["1d"] = torch.randn(333, generator=g)
    tensors["scalar"] = torch.tensor(3.5)
    tensors["empty"] = torch.empty(0, 8)
    return tensors


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8) if tensor.numel() else tensor


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("stored") / "model.safetensors"
    save_file(random_tensors(), path, metadata={"format": "pt"})
    return path


def read_all(path: Path, copies: CheckpointCopies, select: Callable) -> dict[str, torch.Tensor]:
    out = {}
    for tensor in read_index(path):
        rows, cols, shape = select(tensor)
        out[tensor.name] = torch.empty(shape, dtype=tensor.dtype)
        copies.copy(out[tensor.name], tensor, rows, cols)
    return out


@pytest.mark.parametrize(("buffer_bytes", "readers"), [(1 << 20, 1), (256, 3), (4096, 2)])
def test_every_tensor_reads_as_safetensors_reads_it(stored, buffer_bytes, readers):
    with CheckpointCopies(CPU, buffer_bytes, num_buffers=3, readers=readers) as copies:
        got = read_all(stored, copies, lambda t: (None, None, t.shape))
    with safe_open(stored, "pt") as f:
        assert sorted(got) == sorted(f.keys())
        for name, tensor in got.items():
            want = f.get_tensor(name)
            assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
            assert torch.equal(as_bytes(tensor), as_bytes(want)), name


def test_selected_rows_and_columns_convert_as_copy_does(stored):
    """Rows [2, 30) and columns [1, 4) of the 2-d tensors, rows [5, 7) of the others, into
    float32 (64-byte buffers: a few rows a run; the 1200-byte rows of `wide` one by one)."""

    def select(t: StoredTensor):
        if len(t.shape) == 2 and t.shape[0] >= 30:
            return (2, 30), (1, 4), (28, 3)
        if t.shape and t.shape[0] >= 7:
            return (5, 7), None, (2, *t.shape[1:])
        return None, None, t.shape

    with CheckpointCopies(CPU, 64, num_buffers=2, readers=2) as copies:
        got = {}
        for tensor in read_index(stored):
            rows, cols, shape = select(tensor)
            got[tensor.name] = torch.full(shape, float("nan"))
            copies.copy(got[tensor.name], tensor, rows, cols)
    with safe_open(stored, "pt") as f:
        for name, tensor in got.items():
            want = f.get_tensor(name)
            rows, cols, _ = select(next(t for t in read_index(stored) if t.name == name))
            if rows is not None:
                want = want[rows[0] : rows[1]]
            if cols is not None:
                want = want[:, cols[0] : cols[1]]
            assert torch.equal(tensor, torch.empty(want.shape).copy_(want)), name


def test_columns_of_rows_wider_than_a_buffer(tmp_path):
    full = torch.randn(4, 64, 3)
    save_file({"w": full}, tmp_path / "w.safetensors")
    (tensor,) = read_index(tmp_path / "w.safetensors")
    dst = torch.empty(2, 10, 3)
    with CheckpointCopies(CPU, 128, num_buffers=2) as copies:  # a 768-byte row: 128-byte runs
        copies.copy(dst, tensor, (1, 3), (50, 60))
    assert torch.equal(dst, full[1:3, 50:60])


def write_raw(path: Path, header: object, data: bytes = b"") -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def test_broken_files_are_refused_by_name(tmp_path):
    entry = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    cases = {
        "short": (None, b"\x01\x02"),
        "huge header": (None, struct.pack("<Q", 1 << 40)),
        "not json": (None, struct.pack("<Q", 3) + b"{{{"),
        "bad dtype": ({"w": entry | {"dtype": "F4"}}, bytes(16)),
        "bad range": ({"w": entry | {"data_offsets": [0, 12]}}, bytes(16)),
        "past the end": ({"w": entry}, bytes(8)),
    }
    for name, (header, data) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        if header is None:
            path.write_bytes(data)
        else:
            write_raw(path, header, data)
        with pytest.raises(WeightLoadError, match="cannot read"):
            read_index(path)


def test_a_file_cut_short_after_its_header_was_read(tmp_path):
    path = tmp_path / "cut.safetensors"
    save_file({"w": torch.randn(64, 64)}, path)
    (tensor,) = read_index(path)
    path.write_bytes(path.read_bytes()[: tensor.offset + 100])
    with pytest.raises(WeightLoadError, match="ends before byte"), CheckpointCopies(CPU) as c:
        c.copy(torch.empty(64, 64), tensor)


def test_a_mismatched_destination_is_refused(stored):
    tensor = next(t for t in read_index(stored) if t.name == "wide")
    with CheckpointCopies(CPU) as copies, pytest.raises(ValueError, match="cannot copy"):
        copies.copy(torch.empty(3, 299), tensor)


class PlainCopies:
    """The plain loader: each selection read through safetensors and copied with
    `Tensor.copy_` (what `load_weights` did before it read the bytes itself)."""

    def __init__(self, device: torch.device, progress: bool = False) -> None:
        self._files: dict[Path, object] = {}

    def __enter__(self) -> PlainCopies:
        return self

    def __exit__(self, *exc: object) -> None:
        self._files.clear()

    def _tensor(self, stored: StoredTensor) -> torch.Tensor:
        if stored.path not in self._files:
            self._files[stored.path] = safe_open(stored.path, "pt").__enter__()
        return self._files[stored.path].get_tensor(stored.name)

    def copy(self, dst, stored, rows=None, cols=None) -> None:
        tensor = self._tensor(stored)
        if rows is not None:
            tensor = tensor[rows[0] : rows[1]]
        if cols is not None:
            tensor = tensor[:, cols[0] : cols[1]]
        dst.copy_(tensor)

    def read(self, stored: StoredTensor) -> torch.Tensor:
        return self._tensor(stored).clone()


def line(name: str) -> ModelLine:
    """Imported on use: a line that is not installed skips its cases (tests/conftest.py)."""
    if name == "qwen3":
        from pegainfer.models.qwen3.line import Qwen3Line

        return Qwen3Line()
    if name == "qwen35":
        from pegainfer.models.qwen35.line import Qwen35Line

        return Qwen35Line()
    if name == "deepseek":
        from pegainfer.models.deepseek.line import DeepseekLine

        return DeepseekLine()
    if name == "kimi-k2":
        from pegainfer.models.kimi_k2.line import KimiK2Line

        return KimiK2Line()
    from pegainfer.models.glm5.line import Glm5Line

    return Glm5Line()


def write_qwen3_fp8(path: Path) -> None:
    from tests.quant_checkpoints import FP8_BLOCK_CONFIG, quantize_checkpoint
    from tests.qwen3.hf_reference import write_hf_checkpoint
    from tests.qwen3.test_fp8_checkpoint import BLOCK, is_linear

    source = write_hf_checkpoint(path.parent / "qwen3-bf16", tie=False)
    quantize_checkpoint(source, path, FP8_BLOCK_CONFIG | {"weight_block_size": BLOCK}, is_linear)


def write_kimi_int4(path: Path) -> None:
    from tests.kimi_k2.hf_reference import write_hf_checkpoint
    from tests.kimi_k2.test_quantized_checkpoints import FP8_WIDTHS, INT4, is_linear
    from tests.quant_checkpoints import quantize_checkpoint

    source = write_hf_checkpoint(path.parent / "kimi-bf16", **FP8_WIDTHS)
    quantize_checkpoint(source, path, INT4, is_linear)


# (case, line, how the checkpoint is written, model dtype, tensor-parallel rank of 2 or None)
CASES = [
    ("qwen3-sharded", "qwen3", lambda p: line("qwen3").write_tiny_checkpoint(p, num_shards=3),
     torch.float32, None),
    ("qwen3-bf16-rank1", "qwen3", lambda p: line("qwen3").write_tiny_checkpoint(p, seed=2),
     torch.bfloat16, 1),
    ("qwen3-fp8", "qwen3", write_qwen3_fp8, torch.float32, None),
    ("qwen35", "qwen35", lambda p: line("qwen35").write_tiny_checkpoint(p), torch.float32, None),
    ("qwen35-rank0", "qwen35", lambda p: line("qwen35").write_tiny_checkpoint(p),
     torch.float32, 0),
    ("deepseek", "deepseek", lambda p: line("deepseek").write_tiny_checkpoint(p),
     torch.float32, None),
    ("kimi-k2-int4", "kimi-k2", write_kimi_int4, torch.float32, None),
    ("glm5-rank1", "glm5", lambda p: line("glm5").write_tiny_checkpoint(p), torch.float32, 1),
]  # fmt: skip


@pytest.mark.parametrize(("case", "name", "write", "dtype", "rank"), CASES,
                         ids=[case[0] for case in CASES])  # fmt: skip
def test_every_line_loads_as_the_plain_loader_does(
    case, name, write, dtype, rank, tmp_path, monkeypatch
):
    path = tmp_path / case
    write(path)
    group = ParallelGroup() if rank is None else ParallelGroup(rank, 2)
    ctx = ModelContext(path, read_config(path), dtype, CPU, group)

    def build(copies: Callable) -> dict[str, torch.Tensor]:
        monkeypatch.setattr(weights_module, "CheckpointCopies", copies)
        return dict(line(name).build_model(ctx).state_dict())

    # 4 KiB buffers: many runs per tensor, rows split across buffers, three readers.
    ours = build(partial(CheckpointCopies, buffer_bytes=4096, num_buffers=3, readers=3))
    plain = build(PlainCopies)
    assert sorted(ours) == sorted(plain)
    for key, tensor in ours.items():
        assert tensor.dtype == plain[key].dtype, key
        assert torch.equal(as_bytes(tensor), as_bytes(plain[key])), key


def test_nothing_of_the_staging_stays_resident_after_a_load(tmp_path):
    """48 MiB read through a 64 MiB staging buffer (resident as it is written): once the
    copies are closed, the process holds no more than it did before (the buffers were freed)."""
    save_file({f"w{i}": torch.randn(1024, 1024) for i in range(12)}, tmp_path / "w.safetensors")
    tensors = read_index(tmp_path / "w.safetensors")
    dst = {t.name: torch.zeros(t.shape) for t in tensors}  # resident before the load
    before = rss_bytes()
    with CheckpointCopies(CPU) as copies:
        for tensor in tensors:
            copies.copy(dst[tensor.name], tensor)
    assert rss_bytes() - before < 8 << 20
    with safe_open(tmp_path / "w.safetensors", "pt") as f:
        assert all(torch.equal(dst[name], f.get_tensor(name)) for name in dst)
