"""`pegainfer-bench startup`: process start to HTTP-ready, cold and warm, and idle memory.

Each run starts `pegainfer-server` as a user would, polls /health until it answers 200, waits
for the process tree to settle, reads its resident memory (every process: the HTTP server, the
engine, any parallel workers; in all, by role, and the engine's by mapping: libraries, heap,
anonymous memory) and GPU memory, then stops it. The server's own start-up log lines (each
phase's time and RSS) are kept with the run.

Cold runs point FlashInfer's, Triton's and the CUDA driver's kernel caches at empty
directories, so every kernel compiles as on a fresh machine (with `--drop-page-cache`, the
weights are read from disk too); warm runs share caches filled by an earlier run (the first
cold run's, when the caches are this benchmark's own); disk-cold runs read every file from
disk again with the kernel caches warm.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from pegainfer.server.bench import report
from pegainfer.server.bench.options import non_negative_int, subcommand
from pegainfer.server.bench.process_tree import (
    descendants,
    gpu_bytes,
    memory_by_kind,
    resident_by_mapping,
    role,
    rss_bytes,
)

_POLL_S = 0.02
# `StartupLog`'s lines (pegainfer.core.process_info).
_PHASE = re.compile(r"start-up: (?P<phase>.+) at (?P<s>[\d.]+) s, RSS (?P<rss>\d+) MiB")


def cache_env(cache_dir: Path) -> dict[str, str]:
    """The kernel caches under `cache_dir`, laid out as in a home directory (so `--cache-dir ~`
    means the user's own caches)."""
    return {
        "FLASHINFER_WORKSPACE_BASE": str(cache_dir),
        "TRITON_CACHE_DIR": str(cache_dir / ".triton" / "cache"),
        "CUDA_CACHE_PATH": str(cache_dir / ".nv" / "ComputeCache"),
    }


def phases(log: str) -> list[dict[str, Any]]:
    """The engine's start-up phases from a server log: seconds since its process started, RSS."""
    return [
        {"phase": m["phase"], "s": float(m["s"]), "rss_mib": int(m["rss"])}
        for m in _PHASE.finditer(log)
    ]


def drop_page_cache() -> bool:
    """Write the dirty pages and drop the clean ones (root only), so the checkpoint and the
    libraries are read from disk as on a fresh machine; False where this is not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        return False
    return True


def run_once(
    model: str,
    port: int,
    server_args: list[str],
    cache_dir: Path,
    settle_s: float,
    timeout_s: float,
    log_path: Path,
) -> dict[str, Any]:
    """Start, time readiness, measure idle memory, stop. Raises if the server never gets ready."""
    env = os.environ | cache_env(cache_dir)
    cmd = [sys.executable, "-m", "pegainfer.server.cli", "--model-path", model,
           "--host", "127.0.0.1", "--port", str(port), *server_args]  # fmt: skip
    started = time.perf_counter()
    with open(log_path, "w") as log:  # the child keeps its own descriptor
        process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/health"
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}: "
                                   f"{log_path.read_text()[-2000:]}")  # fmt: skip
            if time.perf_counter() - started > timeout_s:
                raise RuntimeError(f"the server was not ready after {timeout_s} s")
            try:
                if httpx.get(url, timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(_POLL_S)
        ready_s = time.perf_counter() - started
        time.sleep(settle_s)
        tree = descendants(process.pid)
        gpu = gpu_bytes(tree)
        kinds = {f"idle_{kind}_mib": value / 2**20 for kind, value in memory_by_kind(tree).items()}
        by_role: dict[str, float] = {}
        engine_mappings: dict[str, float] = {}
        for pid in tree:
            name = role(pid, process.pid)
            by_role[name] = by_role.get(name, 0.0) + rss_bytes([pid]) / 2**20
            if name == "engine":
                engine_mappings = {path: size / 2**20 for path, size in resident_by_mapping(pid)}
        return {
            "ready_s": ready_s,
            "idle_rss_mib": rss_bytes(tree) / 2**20,
            **kinds,
            "idle_rss_by_role_mib": by_role,
            # Where the engine process's resident memory is: its largest mappings.
            "idle_engine_mappings_mib": engine_mappings,
            "processes": len(tree),
            "gpu_mib": None if gpu is None else gpu / 2**20,
            "phases": phases(log_path.read_text()),
        }
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def main(args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    logs = Path(args.log_dir) if args.log_dir else None
    with tempfile.TemporaryDirectory(prefix="pegainfer-bench-") as tmp:
        own_cache = args.cache_dir is None
        warm_cache = Path(tmp) / "warm" if own_cache else Path(args.cache_dir).expanduser()
        log_dir = logs or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)

        def start(cache: str, cache_dir: Path) -> dict[str, Any]:
            log = log_dir / f"server_{cache}{len(runs)}.log"
            run = run_once(args.model_path, args.port, args.server_args, cache_dir,
                           args.settle, args.timeout, log)  # fmt: skip
            gpu = "" if run["gpu_mib"] is None else f", GPU {run['gpu_mib']:.0f} MiB"
            pss = run.get("idle_pss_mib")
            pss = "" if pss is None else f" (PSS {pss:.0f} MiB)"
            roles = run["idle_rss_by_role_mib"]
            parts = ", ".join(f"{name} {mib:.0f}" for name, mib in roles.items())
            print(f"{cache} run {len(runs)}: ready in {run['ready_s']:.2f} s, idle RSS "
                  f"{run['idle_rss_mib']:.0f} MiB{pss} over {run['processes']} processes "
                  f"({parts}){gpu}", flush=True)  # fmt: skip
            mappings = list(run["idle_engine_mappings_mib"].items())
            largest = ", ".join(f"{Path(path).name} {mib:.0f}" for path, mib in mappings[:6])
            print(f"  the engine's largest resident mappings (MiB): {largest}", flush=True)
            return {"cache": cache, **run}

        for i in range(args.cold_runs):
            # The first cold run fills this benchmark's own warm cache (empty until then).
            cold = warm_cache if own_cache and i == 0 else Path(tmp) / f"cold{i}"
            dropped = args.drop_page_cache and drop_page_cache()
            runs.append({**start("cold", cold), "page_cache_dropped": dropped})
        if (args.warm_runs or args.disk_cold_runs) and not (own_cache and args.cold_runs):
            start("filling", warm_cache)  # fills the warm cache; not counted
        for _ in range(args.warm_runs):
            runs.append(start("warm", warm_cache))
        for _ in range(args.disk_cold_runs):
            # Kernels cached, files not: a first start after the caches were restored.
            if not drop_page_cache():
                print("disk-cold runs skipped: the page cache cannot be dropped here (root only)")
                break
            runs.append(start("disk-cold", warm_cache))
    result = {
        "benchmark": "startup",
        **report.run_metadata(server_version=None),
        "model": args.model_path,
        "server_args": args.server_args,
        "runs": runs,
    }
    if args.result_json:
        report.write_json(args.result_json, result)
    return result


def add_parser(subparsers: Any) -> None:
    parser = subcommand(subparsers, "startup", __doc__)
    parser.add_argument("--model-path", required=True, help="checkpoint to serve")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--cold-runs", type=non_negative_int, default=1)
    parser.add_argument("--warm-runs", type=non_negative_int, default=3)
    parser.add_argument("--settle", type=float, default=2.0, help="seconds idle before measuring")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="home of the kernel caches for warm runs, e.g. ~ (default: a temporary directory "
        "the first cold run fills)",
    )
    parser.add_argument(
        "--server-args",
        type=shlex.split,
        default=[],
        help="extra pegainfer-server arguments as one string, e.g. '--max-model-len 8192'",
    )
    parser.add_argument(
        "--disk-cold-runs",
        type=non_negative_int,
        default=0,
        help="after the warm runs, starts with the kernel caches warm and the page cache "
        "dropped (root): a first start on a machine whose kernel caches were restored",
    )
    parser.add_argument(
        "--drop-page-cache",
        action="store_true",
        help="before each cold run, drop the OS page cache (root), so the weights come from disk",
    )
    parser.add_argument("--log-dir", default=None, help="keep each run's server log here")
    parser.add_argument("--result-json", default=None)
    parser.set_defaults(run=main)
