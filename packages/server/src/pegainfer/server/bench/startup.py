"""`pegainfer-bench startup`: process start to HTTP-ready, cold and warm, and idle memory.

Each run starts `pegainfer-server` as a user would, polls /health until it answers 200, waits
for the process tree to settle, reads its resident memory (all processes) and GPU memory,
then stops it. Cold runs point FlashInfer's and Triton's kernel caches at empty directories,
so every kernel compiles; warm runs share caches filled by an earlier run.
"""

from __future__ import annotations

import argparse
import os
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
from pegainfer.server.bench.options import subcommand
from pegainfer.server.bench.process_tree import descendants, gpu_bytes, rss_bytes

_POLL_S = 0.02


def run_once(
    model: str,
    port: int,
    server_args: list[str],
    cache_dir: Path,
    settle_s: float,
    timeout_s: float,
) -> dict[str, Any]:
    """Start, time readiness, measure idle memory, stop. Raises if the server never gets ready."""
    # Laid out as in a home directory, so `--cache-dir ~` means the user's own caches.
    env = os.environ | {
        "FLASHINFER_WORKSPACE_BASE": str(cache_dir),
        "TRITON_CACHE_DIR": str(cache_dir / ".triton" / "cache"),
    }
    cmd = [sys.executable, "-m", "pegainfer.server.cli", "--model-path", model,
           "--host", "127.0.0.1", "--port", str(port), *server_args]  # fmt: skip
    started = time.perf_counter()
    process = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}/health"
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}: "
                                   f"{process.stderr.read().decode()[-2000:]}")  # fmt: skip
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
        return {
            "ready_s": ready_s,
            "idle_rss_mib": rss_bytes(tree) / 2**20,
            "processes": len(tree),
            "gpu_mib": None if gpu is None else gpu / 2**20,
        }
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def main(args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    with tempfile.TemporaryDirectory(prefix="pegainfer-bench-") as tmp:
        warm_cache = Path(args.cache_dir) if args.cache_dir else Path(tmp) / "warm"

        def start(cache: Path) -> dict[str, Any]:
            return run_once(
                args.model_path, args.port, args.server_args, cache, args.settle, args.timeout
            )

        for i in range(args.cold_runs):
            runs.append({"cache": "cold", **start(Path(tmp) / f"cold{i}")})
            print(f"cold run {i}: ready in {runs[-1]['ready_s']:.2f} s", flush=True)
        start(warm_cache)  # fills the warm cache; not counted
        for i in range(args.warm_runs):
            runs.append({"cache": "warm", **start(warm_cache)})
            print(
                f"warm run {i}: ready in {runs[-1]['ready_s']:.2f} s, "
                f"idle RSS {runs[-1]['idle_rss_mib']:.0f} MiB",
                flush=True,
            )
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
    parser.add_argument("--cold-runs", type=int, default=1)
    parser.add_argument("--warm-runs", type=int, default=3)
    parser.add_argument("--settle", type=float, default=2.0, help="seconds idle before measuring")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="home of the kernel caches for warm runs, e.g. ~ (default: a temporary directory)",
    )
    parser.add_argument(
        "--server-args",
        type=shlex.split,
        default=[],
        help="extra pegainfer-server arguments as one string, e.g. '--max-model-len 8192'",
    )
    parser.add_argument("--result-json", default=None)
    parser.set_defaults(run=main)
