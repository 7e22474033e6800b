"""Where a running process tree's resident memory lives: RSS per mapping (file, [heap],
anonymous), per process, from /proc/PID/smaps (Linux). For the idle footprint of
`pegainfer-server` (issue 21):

    python benchmarks/rss_by_mapping.py PID [--top 25] [--out rss.json]

PID is the server's process; its children (the engine process, the resource tracker) are
included. Anonymous memory is split by how it was mapped where the kernel tells (the heap,
stacks, large anonymous mappings by size class), since that is where CUDA's host allocations,
pinned buffers and Python's arenas land.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path


def children(pid: int) -> list[int]:
    """`pid` and every descendant (breadth first)."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop(0)
        found.append(current)
        for task in Path(f"/proc/{current}/task").iterdir():
            kids = (task / "children").read_text().split()
            queue.extend(int(kid) for kid in kids)
    return found


def _label(path: str, size_kib: int) -> str:
    if path and not path.startswith("["):
        return path
    if path:
        return path  # [heap], [stack], [vdso], [anon:...]
    # Anonymous mappings: bucket by size, since glibc arenas, CUDA and pinned pools differ.
    if size_kib >= 1 << 20:
        return "[anon >= 1 GiB]"
    if size_kib >= 64 << 10:
        return "[anon 64 MiB - 1 GiB]"
    if size_kib >= 1 << 10:
        return "[anon 1 - 64 MiB]"
    return "[anon < 1 MiB]"


def rss_by_mapping(pid: int) -> tuple[Counter[str], dict[str, int]]:
    """RSS in KiB per mapping label, and the process's totals from smaps_rollup."""
    per_label: Counter[str] = Counter()
    label, size = "", 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            path = fields[5] if len(fields) >= 6 else ""
            start, end = (int(x, 16) for x in fields[0].split("-"))
            size = (end - start) >> 10
            label = _label(path, size)
        elif fields[0] == "Rss:":
            per_label[label] += int(fields[1])
    totals = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split()[:2]
        totals[key.rstrip(":")] = int(value)
    return per_label, totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pid", type=int)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = []
    for pid in children(args.pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip()
        per_label, totals = rss_by_mapping(pid)
        top = per_label.most_common(args.top)
        report.append({"pid": pid, "cmdline": cmdline[:200], "totals_kib": totals,
                       "top_kib": dict(top)})  # fmt: skip
        rss, pss, anon = (totals.get(key, 0) >> 10 for key in ("Rss", "Pss", "Anonymous"))
        print(f"pid {pid} ({cmdline[:100]}): Rss {rss} MiB, Pss {pss} MiB, anon {anon} MiB")
        for name, kib in top:
            print(f"  {kib >> 10:7d} MiB  {name}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
