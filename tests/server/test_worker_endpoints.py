"""What a router in front of a fleet asks of each worker: /get_load, /get_model_info and
/get_server_info (SGLang's names, which vllm-router and sglang-router call)."""

from __future__ import annotations

import json

import httpx

from tests.server.helpers import wait_until


def test_get_model_info_names_the_checkpoint(server):
    response = httpx.get(server.url + "/get_model_info", timeout=30)
    assert response.status_code == 200
    assert response.json() == {
        "model_path": server.model,
        "tokenizer_path": server.model,
        "served_model_names": [server.model],
        "is_generation": True,
    }


def test_get_server_info_gives_the_cache_layout(server):
    response = httpx.get(server.url + "/get_server_info", timeout=30)
    assert response.status_code == 200
    info = response.json()
    # The shared server runs with --max-model-len 512 --block-size 8, one rank.
    assert info["kv_block_size"] == 8
    assert info["model_id"] == server.model
    assert info["max_model_len"] == 512
    assert info["dp_size"] == 1 and info["tp_size"] == 1
    assert info["num_kv_blocks"] >= 512 // 8
    assert info["model_path"] == server.model
    assert info["version"] == httpx.get(server.url + "/version", timeout=30).json()["version"]


def test_get_load_counts_requests_in_flight(server):
    def load() -> int:
        return httpx.get(server.url + "/get_load", timeout=30).json()["load"]

    wait_until(lambda: load() == 0, what="an idle server")
    body = {
        "model": server.model, "prompt": "count", "max_tokens": 480, "ignore_eos": True,
        "stream": True,
    }  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["choices"]
        assert load() == 1  # still going: 480 tokens near the 512-token context take longer
    # The client went away: the request is aborted and leaves the count.
    wait_until(lambda: load() == 0, what="the aborted request to leave the load")


def test_kv_event_sources_is_empty_without_events(server):
    response = httpx.get(server.url + "/kv_event_sources", timeout=30)
    assert response.status_code == 200
    assert response.json() == {}
