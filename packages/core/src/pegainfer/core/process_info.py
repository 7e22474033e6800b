"""A process's age and resident memory, read from /proc (Linux), and the start-up log built on
them: each phase of an engine's start with the seconds since the process began and its RSS, so
a slow or large start shows where the time and the memory went. Also giving freed memory back
to the system (`release_freed_memory`) and how a child process follows its parent out
(`exit_with_parent`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import multiprocessing as mp
import os
from functools import cache
from multiprocessing import connection as mp_connection
from pathlib import Path

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_MIB = 1 << 20


def since_process_start() -> float:
    """Seconds since this process was created (the kernel's start time, not Python's)."""
    stat = Path("/proc/self/stat").read_text()
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - start_ticks / _CLOCK_TICKS


def rss_bytes(pid: int | None = None) -> int:
    """VmRSS of process `pid` (this one by default); 0 for a process that has exited."""
    try:
        status = Path(f"/proc/{pid or 'self'}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0  # a zombie has no memory left


def memory_kinds(pid: int | None = None) -> dict[str, int]:
    """Bytes of process `pid` (this one by default) by kind: resident anonymous memory (heap,
    pinned buffers), resident file pages (libraries, memory maps: shared with any process that
    maps the same files, so a sum of RSS counts them once per process) and its proportional
    set size (each shared page split among the processes holding it). Empty for a process
    that has exited."""
    kinds: dict[str, int] = {}
    try:
        status = Path(f"/proc/{pid or 'self'}/status").read_text()
        rollup = Path(f"/proc/{pid or 'self'}/smaps_rollup").read_text()
    except OSError:
        return kinds
    for text, fields in ((status, ("RssAnon", "RssFile", "RssShmem")), (rollup, ("Pss",))):
        for line in text.splitlines():
            name, _, value = line.partition(":")
            if name in fields:
                kinds[name.lower().replace("rss", "rss_")] = int(value.split()[0]) * 1024
    return kinds


@cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None  # glibc only


def release_freed_memory() -> None:
    """Give the memory this process has freed back to the system (glibc's `malloc_trim`; a
    no-op elsewhere). glibc keeps freed blocks in its arenas for reuse, so a process that once
    held a lot (a 10 MB prompt tokenized: ~450 MB; a tokenizer.json parsed: ~90 MB for
    Qwen3's) stays that large. Milliseconds; the pages given back fault in again when used."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


class StartupLog:
    """Logs `start-up: <phase>` lines with the process's age, its RSS and the RSS the phase
    added."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._rss = rss_bytes()

    def mark(self, phase: str) -> None:
        rss = rss_bytes()
        self._logger.info("start-up: %s at %.2f s, RSS %d MiB (%+d MiB)", phase,
                          since_process_start(), rss / _MIB, (rss - self._rss) / _MIB)  # fmt: skip
        self._rss = rss


def exit_with_parent(sentinel: int | None = None) -> None:
    """End this process when its parent's ends, even while its main thread is blocked in a
    collective or a device sync, where it would never see a pipe close. The parent's end shows
    on `sentinel` (a descriptor readable once the parent has gone), by default multiprocessing's
    (a child it started). Run it in a daemon thread."""
    if sentinel is None:
        parent = mp.parent_process()
        if parent is None:
            return
        sentinel = parent.sentinel
    mp_connection.wait([sentinel])
    os._exit(1)
