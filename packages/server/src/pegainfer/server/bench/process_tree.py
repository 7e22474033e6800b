"""Resident memory of a process tree, from /proc (Linux), and its GPU memory, from nvidia-smi."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from pegainfer.core.process_info import memory_kinds
from pegainfer.core.process_info import rss_bytes as process_rss

_PROC = Path("/proc")


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        for task in (_PROC / str(current) / "task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            queue.extend(int(child) for child in children)
    return found


def role(pid: int, root: int) -> str:
    """What process `pid` of the server rooted at `root` is: "http" (the server's own process,
    which serves HTTP), "engine" (the engine process it spawned), "resource tracker"
    (multiprocessing's helper) or "worker" (a parallel rank, below the engine)."""
    if pid == root:
        return "http"
    try:
        command = (_PROC / str(pid) / "cmdline").read_bytes()
        parent = int((_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return "exited"
    if b"resource_tracker" in command:
        return "resource tracker"
    return "engine" if parent == root else "worker"


def resident_by_mapping(pid: int, top: int = 12) -> list[tuple[str, int]]:
    """What process `pid` keeps resident, by what it maps, largest first (the `top` largest):
    each file (a library, a memory-mapped checkpoint), "[heap]", "[anon]" (anonymous mappings:
    torch's and CUDA's allocations, page-locked buffers, loaded GPU modules), "[stack]"...,
    with its resident bytes. Empty for a process that has exited."""
    try:
        lines = (_PROC / str(pid) / "smaps").read_text().splitlines()
    except OSError:
        return []
    resident: dict[str, int] = {}
    name = "[anon]"
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) >= 5 and "-" in parts[0] and ":" in parts[3]:  # a mapping's header
            name = parts[5].strip() if len(parts) == 6 else "[anon]"
        elif parts and parts[0] == "Rss:":
            resident[name] = resident.get(name, 0) + int(parts[1]) * 1024
    return sorted(resident.items(), key=lambda item: -item[1])[:top]


def rss_bytes(pids: list[int]) -> int:
    """Sum of VmRSS over `pids` (processes that exited meanwhile count as 0)."""
    return sum(process_rss(pid) for pid in pids)


def memory_by_kind(pids: list[int]) -> dict[str, int]:
    """Sums over `pids` of `memory_kinds`: anonymous and file-backed RSS, and PSS (the tree's
    own share of the shared pages: what it costs the machine)."""
    total: dict[str, int] = {}
    for pid in pids:
        for kind, value in memory_kinds(pid).items():
            total[kind] = total.get(kind, 0) + value
    return total


def gpu_bytes(pids: list[int]) -> int | None:
    """GPU memory the processes hold, per nvidia-smi; None where there is no nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    wanted = set(pids)
    total = 0
    for line in out.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip().isdigit() and int(pid) in wanted:
            total += int(used.strip()) << 20
    return total
