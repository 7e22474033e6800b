"""Where each tensor of a safetensors file lies, from the file's header alone.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range in the data that follows, then the data. Knowing the
ranges, the loader reads exactly the bytes a parameter needs (a tensor-parallel rank's rows,
none of an unmapped tensor), on several threads, straight into its staging buffers
(`staging.py`); nothing is memory-mapped.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from pegainfer.core.errors import WeightLoadError

# The safetensors format's dtype names (those torch has).
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}
# A header larger than this is not a safetensors header (the format's own limit).
_MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a checkpoint file: its bytes are `nbytes` at `offset` of `path`, rows of
    `row_bytes` along its first dimension (a 0-d tensor is one row)."""

    name: str
    path: Path
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    @property
    def num_rows(self) -> int:
        return self.shape[0] if self.shape else 1


def read_index(path: Path) -> list[StoredTensor]:
    """The tensors of safetensors file `path`, by name (as safetensors lists them; writers
    store them in about that order too)."""

    def bad(why: str) -> WeightLoadError:
        return WeightLoadError(f"cannot read {path}: {why}")

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise bad("the file is shorter than a safetensors header")
            (header_bytes,) = struct.unpack("<Q", head)
            if header_bytes > min(size - 8, _MAX_HEADER_BYTES):
                raise bad(f"its header claims {header_bytes} bytes")
            header = json.loads(f.read(header_bytes))
    except OSError as exc:
        raise bad(exc.strerror or str(exc)) from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(f"its header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    data_start = 8 + header_bytes
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (TypeError, KeyError, ValueError) as exc:
            raise bad(f"tensor {name!r} has no dtype, shape and data_offsets") from exc
        dtype = DTYPES.get(dtype_name)
        if dtype is None:
            raise bad(f"tensor {name!r} has dtype {dtype_name}, which torch cannot hold")
        stored = StoredTensor(name, path, data_start + begin, dtype, tuple(shape))
        if end - begin != stored.nbytes or begin < 0 or data_start + end > size:
            raise bad(f"tensor {name!r}'s bytes [{begin}, {end}) do not hold a {dtype_name} "
                      f"tensor of shape {list(shape)} within the file")  # fmt: skip
        tensors.append(stored)
    return sorted(tensors, key=lambda t: t.name)
