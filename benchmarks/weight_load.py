"""How fast a checkpoint's weights reach the GPU, beside what the machine allows (issue 21).

    python benchmarks/weight_load.py MODEL_DIR [--readers 1 4 8] [--buffer-mib 64] [--repeat 2]
                                               [--device cuda]

For each number of reader threads and staging buffer size: the line's `build_model` (meta
model, device storage, `load_weights` through `CheckpointCopies`), timed to the last copy, in
GB/s of parameters. Beside them the two limits of the path: the page cache read into a host
buffer by the same threads (`os.preadv`), and one page-locked host buffer copied to the device.
Run it on a checkpoint the page cache holds (a second run, or after `cat DIR/* > /dev/null`):
seconds in all for an 8 GB model.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch

from pegainfer.core.loading import weights as weights_module
from pegainfer.core.loading.model_files import read_config
from pegainfer.core.loading.staging import CheckpointCopies
from pegainfer.core.loading.weights import checkpoint_files
from pegainfer.core.model import ModelContext
from pegainfer.core.plugins import detect_model_line, model_lines

_GB = 1e9
_CHUNK = 8 << 20


def page_cache_rate(files: list[Path], readers: int) -> float:
    """GB/s of reading `files` into one host buffer per thread, in chunks, on `readers`
    threads."""
    chunks = [(f, offset) for f in files for offset in range(0, f.stat().st_size, _CHUNK)]

    def read(part: list[tuple[Path, int]]) -> int:
        buffer = bytearray(_CHUNK)
        done = 0
        for path, offset in part:
            fd = os.open(path, os.O_RDONLY)
            try:
                done += os.preadv(fd, [buffer], offset)
            finally:
                os.close(fd)
        return done

    parts = [chunks[i::readers] for i in range(readers)]
    start = time.perf_counter()
    with ThreadPoolExecutor(readers) as pool:
        total = sum(pool.map(read, parts))
    return total / (time.perf_counter() - start) / _GB


def host_to_device_rate(nbytes: int = 1 << 30) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)  # the first copy sets things up
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - start) / _GB


def load_seconds(
    model_dir: Path, readers: int, buffer_bytes: int, device: torch.device
) -> tuple[float, int]:
    config = read_config(model_dir)
    line = detect_model_line(config, model_lines())
    weights_module.CheckpointCopies = partial(CheckpointCopies, buffer_bytes=buffer_bytes,
                                              readers=readers)  # fmt: skip
    ctx = ModelContext(model_dir, config, torch.bfloat16, device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    model = line.build_model(ctx)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return seconds, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--readers", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--buffer-mib", type=int, nargs="+", default=[64])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--device", default="cuda", help="cpu: the reads and copies alone")
    options = parser.parse_args()
    files = checkpoint_files(options.model_dir)
    size = sum(f.stat().st_size for f in files)
    print(f"{options.model_dir}: {len(files)} files, {size / _GB:.2f} GB; "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    device = torch.device(options.device)
    if device.type == "cuda":
        torch.zeros(1, device=device)
        print(f"pinned host -> device: {host_to_device_rate():.1f} GB/s")
    for readers in options.readers:
        print(f"page cache -> host, {readers} threads: {page_cache_rate(files, readers):.1f} GB/s")
    for buffer_mib in options.buffer_mib:
        for readers in options.readers:
            for attempt in range(options.repeat):
                seconds, nbytes = load_seconds(options.model_dir, readers, buffer_mib << 20,
                                               device)  # fmt: skip
                print(f"build_model, {readers} readers, {buffer_mib} MiB buffers, run "
                      f"{attempt + 1}: {seconds:.2f} s, {nbytes / _GB / seconds:.1f} GB/s of "
                      f"{nbytes / _GB:.2f} GB parameters")  # fmt: skip


if __name__ == "__main__":
    main()
