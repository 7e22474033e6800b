"""`pegainfer-bench startup` against the tiny checkpoint on the CPU."""

from __future__ import annotations

import argparse
import json
import os

from pegainfer.server.bench import startup
from pegainfer.server.bench.process_tree import descendants, rss_bytes
from tests.server.conftest import free_port


def test_process_tree_memory_counts_children():
    pids = descendants(os.getppid())
    assert os.getpid() in pids
    assert rss_bytes([os.getpid()]) > 10 << 20
    assert rss_bytes(pids) > rss_bytes([os.getpid()])


def test_startup_cold_and_warm(tiny_model, tmp_path):
    out = tmp_path / "startup.json"
    args = argparse.Namespace(
        model_path=str(tiny_model), port=free_port(), cold_runs=1, warm_runs=1, settle=0.2,
        timeout=60.0, cache_dir=None, server_args=["--device", "cpu", "--max-model-len", "256"],
        result_json=str(out),
    )  # fmt: skip
    result = startup.main(args)
    assert [r["cache"] for r in result["runs"]] == ["cold", "warm"]
    for run in result["runs"]:
        assert 0 < run["ready_s"] < 60
        # torch alone keeps a few hundred MiB resident; the tree is the server process.
        assert 100 < run["idle_rss_mib"] < 4096
        assert run["processes"] >= 1
    assert json.loads(out.read_text()) == result
