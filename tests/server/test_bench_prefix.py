"""`pegainfer-bench prefix` against the shared tiny server (block size 8)."""

from __future__ import annotations

import json

from pegainfer.server.bench import cli


def test_prefix_ladder_hits_the_cache_when_warm(server, tmp_path):
    out = tmp_path / "prefix.json"
    cli.main([
        "prefix", "--base-url", server.url, "--lengths", "20,41", "--warm-runs", "3",
        "--seed", "7", "--result-json", str(out),
    ])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["benchmark"] == "prefix"
    assert [row["prompt_len"] for row in result["rows"]] == [20, 41]
    for row in result["rows"]:
        assert row["failed"] == 0
        assert row["cold_ttft_ms"] > 0
        assert 0 < row["warm_ttft_p50_ms"] <= row["warm_ttft_p99_ms"]
        # Every full block but the one holding the last prompt token comes from the cache.
        assert row["warm_cached_tokens"] == (row["prompt_len"] - 1) // 8 * 8


def test_chat_prefix_ladder_sends_messages_and_hits_the_cache(server, tmp_path):
    out = tmp_path / "prefix.json"
    cli.main([
        "prefix", "--base-url", server.url, "--lengths", "40", "--warm-runs", "2", "--chat",
        "--seed", "7", "--result-json", str(out),
    ])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["chat"] is True
    (row,) = result["rows"]
    assert row["failed"] == 0
    # The message's full blocks at least (the template adds its own tokens around it).
    assert row["warm_cached_tokens"] >= 40 // 8 * 8
