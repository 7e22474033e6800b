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
        result_json=str(out), log_dir=str(tmp_path / "logs"), drop_page_cache=False,
        disk_cold_runs=0,
    )  # fmt: skip
    result = startup.main(args)
    assert [r["cache"] for r in result["runs"]] == ["cold", "warm"]
    assert result["runs"][0]["page_cache_dropped"] is False
    # The cold run filled the warm cache: two starts in all, each with its log.
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "server_cold0.log",
        "server_warm1.log",
    ]
    for run in result["runs"]:
        assert 0 < run["ready_s"] < 60
        # torch keeps a few hundred MiB resident in the engine process; the HTTP process has
        # no torch.
        assert 100 < run["idle_rss_mib"] < 1024
        roles = run["idle_rss_by_role_mib"]
        assert set(roles) == {"http", "engine"}, roles  # no multiprocessing resource tracker
        assert roles["http"] < 200 < roles["engine"], roles
        assert abs(sum(roles.values()) - run["idle_rss_mib"]) < 1
        mappings = run["idle_engine_mappings_mib"]
        assert any("libtorch" in path for path in mappings), mappings
        assert sum(mappings.values()) <= roles["engine"] + 1
        # Shared pages (libraries) count once per process in the RSS sum, split in PSS.
        assert 50 < run["idle_pss_mib"] < run["idle_rss_mib"]
        assert run["idle_rss_anon_mib"] + run["idle_rss_file_mib"] <= run["idle_rss_mib"] + 1
        assert run["processes"] >= 2
        names = [phase["phase"] for phase in run["phases"]]
        assert names[0] == "engine process started" and names[-1] == "engine ready", names
        assert "model loaded" in names, names
        assert all(0 < phase["s"] < run["ready_s"] + 5 for phase in run["phases"])
    assert json.loads(out.read_text()) == result


def test_phases_are_read_from_the_log():
    log = (
        "x INFO pegainfer.core.engine.core: start-up: model loaded at 3.25 s, RSS 812 MiB "
        "(+90 MiB)\nother line\n... start-up: engine ready at 4.50 s, RSS 900 MiB (+88 MiB)"
    )
    assert startup.phases(log) == [
        {"phase": "model loaded", "s": 3.25, "rss_mib": 812},
        {"phase": "engine ready", "s": 4.5, "rss_mib": 900},
    ]
