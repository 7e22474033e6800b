"""The resident-memory floor of torch and CUDA, step by step, in one fresh process (issue 21).

The engine process rests at ~1.38 GB on an H200 (Qwen3-4B). This script takes the steps every
CUDA engine takes, one after another, and prints the process's resident memory after each
(anonymous and file-backed, from /proc/self/status; the heap and the largest anonymous
mappings, from /proc/self/smaps), so what torch, the CUDA driver, cuBLAS, FlashInfer, Triton
and graphs cost by themselves can be told apart from what the engine adds:

    python benchmarks/rss_floor.py [--glibc] [--json OUT]

Steps: the interpreter; `import torch`; a CUDA context (a tensor on the device); torch's own
kernels that a step and the sampler run (softmax, top-k, sort, cumsum, multinomial, indexing);
bf16 matmuls (cuBLAS/cuBLASLt load); a FlashInfer paged decode and prefill at Qwen3-4B's
attention shapes (32 query heads, 8 KV heads, head dim 128; when flashinfer imports); a Triton
kernel; a CUDA graph captured and replayed; `malloc_trim(0)`. `CUDA_MODULE_LOADING` is left as
the environment sets it (printed). `--glibc` adds glibc's `mallinfo2()` after each step: bytes
its arenas took from the system (`arena`), in mmapped chunks (`hblkhd`), in use (`uordblks`)
and free but kept (`fordblks`). Seconds on a GPU machine; without CUDA only the first two
steps run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

_MIB = 1 << 20
_START = time.perf_counter()


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost",
    )]  # fmt: skip


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6")


def status_mib() -> dict[str, float]:
    """VmRSS and its anonymous, file and shared-memory parts, in MiB."""
    fields = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in fields:
            out[fields[name]] = int(value.split()[0]) / 1024
    return out


def mappings_mib() -> dict[str, float]:
    """Resident MiB of [heap], of all other anonymous mappings and of the device files
    (/dev/nvidia*: the driver's pinned and mapped memory), from /proc/self/smaps."""
    totals = {"heap": 0.0, "other_anon": 0.0, "dev_nvidia": 0.0}
    label = ""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            label = head[5] if len(head) > 5 else ""
        elif line.startswith("Rss:"):
            kib = int(head[1])
            if label == "[heap]":
                totals["heap"] += kib / 1024
            elif label.startswith("/dev/nvidia"):
                totals["dev_nvidia"] += kib / 1024
            elif not label or label.startswith("[anon"):
                totals["other_anon"] += kib / 1024
    return totals


def mallinfo_mib() -> dict[str, float]:
    libc = _libc()
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return {name: getattr(info, name) / _MIB
            for name in ("arena", "hblkhd", "uordblks", "fordblks", "keepcost")}  # fmt: skip


def record(step: str, rows: list[dict], glibc: bool) -> None:
    row = {"step": step, "s": round(time.perf_counter() - _START, 3), **status_mib(),
           **mappings_mib()}  # fmt: skip
    if glibc:
        row["mallinfo2"] = mallinfo_mib()
    rows.append(row)
    line = (f"{step:<34} {row['s']:6.2f} s  RSS {row['rss']:7.1f}  anon {row['anon']:7.1f}  "
            f"file {row['file']:6.1f}  heap {row['heap']:6.1f}  other anon "
            f"{row['other_anon']:6.1f}  /dev/nvidia* {row['dev_nvidia']:5.1f} MiB")  # fmt: skip
    if glibc:
        line += "  mallinfo2 " + " ".join(f"{k} {v:.1f}" for k, v in row["mallinfo2"].items())
    print(line, flush=True)


def cuda_steps() -> list[tuple[str, Callable[[], object]]]:
    import torch

    device = torch.device("cuda")
    kept: list[object] = []  # what each step made stays alive, as in an engine

    def context() -> None:
        kept.append(torch.zeros(1, device=device))
        torch.cuda.synchronize()

    def torch_kernels() -> None:
        """What a step and the sampler run besides GEMMs: elementwise, reductions, softmax,
        sort, top-k, cumulative sums, sampling, indexing (torch's own kernel modules load)."""
        x = torch.randn(256, 151936, device=device)
        probs = torch.softmax(x * 0.7, dim=-1)
        top = torch.topk(probs, 20, dim=-1)
        ordered, _ = torch.sort(probs[:8], dim=-1, descending=True)
        kept.append(torch.cumsum(ordered, dim=-1))
        kept.append(torch.multinomial(top.values, 1))
        kept.append(x.to(torch.bfloat16).index_select(0, torch.arange(0, 256, 2, device=device)))
        kept.append(torch.nn.functional.silu(x[:, :4096]) * x[:, 4096:8192])
        torch.cuda.synchronize()

    def matmul() -> None:
        a = torch.randn(4096, 2560, device=device, dtype=torch.bfloat16)
        b = torch.randn(2560, 9728, device=device, dtype=torch.bfloat16)
        kept.append(a @ b)
        kept.append(a[:8] @ b)  # a decode-sized GEMM: another cuBLASLt kernel
        torch.cuda.synchronize()

    def attention() -> str | None:
        try:
            import flashinfer
        except ImportError:
            return "flashinfer not importable: skipped"
        heads, kv_heads, head_dim, page, pages_per_seq, seqs = 32, 8, 128, 16, 8, 4
        kv = torch.randn(seqs * pages_per_seq, 2, page, kv_heads, head_dim, device=device,
                         dtype=torch.bfloat16)  # fmt: skip
        indptr = torch.arange(0, seqs + 1, dtype=torch.int32, device=device) * pages_per_seq
        indices = torch.arange(seqs * pages_per_seq, dtype=torch.int32, device=device)
        last = torch.full((seqs,), page, dtype=torch.int32, device=device)
        workspace = torch.empty(128 * _MIB, dtype=torch.uint8, device=device)
        decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                               use_tensor_cores=True)  # fmt: skip
        decode.plan(indptr, indices, last, heads, kv_heads, head_dim, page,
                    q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)  # fmt: skip
        q = torch.randn(seqs, heads, head_dim, device=device, dtype=torch.bfloat16)
        kept.append(decode.run(q, kv))
        prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
        tokens = 64
        qo = torch.arange(0, seqs + 1, dtype=torch.int32) * tokens
        prefill.plan(qo, indptr, indices, last, heads, kv_heads, head_dim, page, causal=True,
                     q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)  # fmt: skip
        q = torch.randn(seqs * tokens, heads, head_dim, device=device, dtype=torch.bfloat16)
        kept.append(prefill.run(q, kv))
        kept.extend((decode, prefill, workspace, kv))
        torch.cuda.synchronize()
        return None

    def triton_kernel() -> str | None:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            return "triton not importable: skipped"

        @triton.jit
        def scale(x_ptr, out_ptr, n, factor, block: tl.constexpr):
            offsets = tl.program_id(0) * block + tl.arange(0, block)
            mask = offsets < n
            tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * factor, mask=mask)

        x = torch.randn(1 << 20, device=device)
        out = torch.empty_like(x)
        scale[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), 2.0, block=1024)
        torch.cuda.synchronize()
        if not torch.equal(out, x * 2):
            raise RuntimeError("the Triton kernel computed the wrong values")
        kept.append(out)
        return None

    def graph() -> None:
        a = torch.randn(8, 2560, device=device, dtype=torch.bfloat16)
        b = torch.randn(2560, 2560, device=device, dtype=torch.bfloat16)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            c = torch.relu(a @ b)
        g.replay()
        torch.cuda.synchronize()
        kept.extend((g, c))

    return [
        ("CUDA context", context),
        ("torch kernels (sampler, elementwise)", torch_kernels),
        ("bf16 matmul (cuBLAS, cuBLASLt)", matmul),
        ("FlashInfer decode + prefill", attention),
        ("Triton kernel", triton_kernel),
        ("CUDA graph capture + replay", graph),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--glibc", action="store_true", help="add glibc's mallinfo2() per step")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    options = parser.parse_args()
    print(f"CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', '(unset)')}, "
          f"python {sys.version.split()[0]}")  # fmt: skip
    rows: list[dict] = []
    record("python started", rows, options.glibc)
    import torch

    record(f"import torch {torch.__version__}", rows, options.glibc)
    if torch.cuda.is_available():
        for step, run in cuda_steps():
            note = run()
            if note:
                print(f"  {step}: {note}")
            record(step, rows, options.glibc)
    else:
        print("no CUDA: the device steps are skipped")
    _libc().malloc_trim(0)
    record("malloc_trim(0)", rows, options.glibc)
    if options.json is not None:
        options.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
