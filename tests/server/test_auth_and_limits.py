"""API keys (flag and environment), body and queue limits, and served-model-name aliases.

One extra server carries the flag key, the limits and two aliases; a second takes its key from
$PEGAINFER_API_KEY.
"""

from __future__ import annotations

import asyncio
import collections
import os
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import OpenAI

from pegainfer.server.cli import main
from tests.server.conftest import Server, start_server, stop_server
from tests.server.helpers import (
    MESSAGES,
    PROMPT,
    assert_error,
    assert_serving,
    listen_backlog,
    metrics,
    sse_payloads,
)

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
ALIASES = ["tiny", "tiny-v2"]
MAX_BYTES = 2000


def base_env() -> dict[str, str]:
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    env.pop("PEGAINFER_API_KEY", None)
    return env


@pytest.fixture(scope="module")
def guarded(tiny_model, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("guarded-server") / "server.log"
    server = start_server(
        tiny_model, log,
        "--max-model-len", "512", "--block-size", "8",
        "--api-key", KEY,
        "--served-model-name", *ALIASES,
        "--max-request-bytes", str(MAX_BYTES),
        "--max-waiting-requests", "1",
        "--backlog", "300",
        env=base_env(),
    )  # fmt: skip
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def env_keyed(tiny_model, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("env-key-server") / "server.log"
    env = base_env() | {"PEGAINFER_API_KEY": "from-the-environment"}
    server = start_server(tiny_model, log, "--max-model-len", "256", env=env)
    yield server
    stop_server(server)


V1_CALLS = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
    ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream": True}),
    ("POST", "/invocations", {"prompt": PROMPT, "max_tokens": 2}),  # generates, so guarded too
]


def check_key_required(url: str, key: str) -> None:
    wrong_headers = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": key},  # no "Bearer "
        {"Authorization": f"Bearer {key}x"},
        {"Authorization": f"Basic {key}"},
    ]
    for method, path, body in V1_CALLS:
        for headers in wrong_headers:
            response = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
            assert_error(response, 401, code="invalid_api_key", error_type="authentication_error")
        response = httpx.request(
            method, url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30
        )
        assert response.status_code == 200, (path, response.text)
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(url + path, timeout=30).status_code == 200, path


# ---------------------------------------------------------------------------- API keys


def test_flag_key_guards_v1_only(guarded):
    check_key_required(guarded.url, KEY)
    assert metrics(guarded.url)  # parses, with no key


def test_environment_key_guards_v1_only(env_keyed):
    check_key_required(env_keyed.url, "from-the-environment")


@pytest.mark.parametrize("order", ["key-last", "key-first"])
def test_two_authorization_headers_are_refused(guarded, order):
    headers = [("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {KEY}")]
    if order == "key-first":
        headers.reverse()
    response = httpx.get(guarded.url + "/v1/models", headers=headers, timeout=30)
    assert_error(response, 401, code="invalid_api_key", contains="one Authorization header")


def test_sdk_with_wrong_and_right_key(guarded):
    wrong = OpenAI(base_url=guarded.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as error:
        wrong.models.list()
    assert error.value.status_code == 401
    assert error.value.code == "invalid_api_key"

    right = OpenAI(base_url=guarded.base_url, api_key=KEY, max_retries=0)
    response = right.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert response.usage.completion_tokens == 3


# ---------------------------------------------------------------------- served names


def test_aliases_are_listed_and_served(guarded):
    client = OpenAI(base_url=guarded.base_url, api_key=KEY, max_retries=0)
    models = client.models.list().data
    assert [m.id for m in models] == ALIASES
    assert all(m.model_extra["max_model_len"] == 512 for m in models)
    for alias in ALIASES:
        response = client.completions.create(model=alias, prompt=PROMPT, max_tokens=2)
        assert response.model == alias
    # Without a model the first name answers, and it labels the metrics.
    response = httpx.post(
        guarded.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=AUTH
    )
    assert response.json()["model"] == ALIASES[0]
    assert f'model_name="{ALIASES[0]}"' in httpx.get(guarded.url + "/metrics").text


def test_the_path_name_is_not_served_under_aliases(guarded):
    client = OpenAI(base_url=guarded.base_url, api_key=KEY, max_retries=0)
    for create, kwargs in [
        (client.completions.create, {"prompt": PROMPT}),
        (client.chat.completions.create, {"messages": MESSAGES}),
    ]:
        with pytest.raises(openai.NotFoundError) as error:
            create(model=guarded.model, max_tokens=2, **kwargs)
        assert error.value.code == "model_not_found"
        assert error.value.param == "model"


# ---------------------------------------------------------------------------- body size


def test_oversized_bodies_get_413(guarded):
    big = {"prompt": "x" * (MAX_BYTES + 100), "max_tokens": 2}
    response = httpx.post(guarded.url + "/v1/completions", json=big, headers=AUTH, timeout=30)
    assert_error(response, 413, code="request_too_large")

    # Without a Content-Length (chunked), the limit applies while reading.
    payload = httpx.Request("POST", "/", json=big).content

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(payload), 256):
            yield payload[start : start + 256]

    response = httpx.post(
        guarded.url + "/v1/chat/completions",
        content=chunks(),
        headers=AUTH | {"content-type": "application/json"},
        timeout=30,
    )
    assert "content-length" not in response.request.headers
    assert_error(response, 413, code="request_too_large")

    # Just under the limit is fine.
    fits = {"prompt": "x " * 300, "max_tokens": 2}
    assert len(httpx.Request("POST", "/", json=fits).content) < MAX_BYTES
    response = httpx.post(guarded.url + "/v1/completions", json=fits, headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    assert_serving(guarded.url, headers=AUTH)


# ------------------------------------------------------------------------- queue limit


async def burst(url: str, stream: bool, count: int = 20) -> list[httpx.Response]:
    body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "stream": stream}
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as client:

        async def one() -> httpx.Response:
            response = await client.post("/v1/completions", json=body)
            await response.aread()
            return response

        return await asyncio.gather(*(one() for _ in range(count)))


def check_busy(responses: list[httpx.Response]) -> None:
    statuses = collections.Counter(r.status_code for r in responses)
    assert set(statuses) <= {200, 503}, statuses
    assert statuses[200] >= 1 and statuses[503] >= 1, statuses
    for response in responses:
        if response.status_code == 503:
            assert response.headers["retry-after"] == "1"
            assert_error(response, 503, code="server_busy", error_type="service_unavailable")


def test_waiting_limit_answers_503_with_retry_after(guarded):
    responses = asyncio.run(burst(guarded.url, stream=False))
    check_busy(responses)
    for response in responses:
        if response.status_code == 200:
            assert response.json()["usage"]["completion_tokens"] == 4
    assert_serving(guarded.url, headers=AUTH)


def test_waiting_limit_answers_503_to_streams_too(guarded):
    responses = asyncio.run(burst(guarded.url, stream=True))
    check_busy(responses)
    for response in responses:
        if response.status_code == 200:
            payloads = sse_payloads(response.content)
            assert all("error" not in p for p in payloads), payloads
            # Four tokens, at most one event each (a reader behind gets them coalesced).
            choices = [choice for p in payloads for choice in p["choices"]]
            assert 1 <= len(choices) <= 4 and choices[-1]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": PROMPT, "n": 2}, "n"),
        ("/v1/completions", {"prompt": [PROMPT, PROMPT], "stream": True}, "prompt"),
        ("/v1/chat/completions", {"messages": MESSAGES, "n": 2, "stream": True}, "n"),
    ],
    ids=["completions-n", "completions-prompts-stream", "chat-n-stream"],
)
def test_a_request_larger_than_the_waiting_limit_is_400_not_503(guarded, path, body, param):
    """It can never be admitted, so a 503 with Retry-After would have the client retry forever."""
    response = httpx.post(guarded.url + path, json=body | {"max_tokens": 2}, headers=AUTH,
                          timeout=30)  # fmt: skip
    error = assert_error(response, 400, param=param, contains="--max-waiting-requests")
    assert "retry-after" not in response.headers, error


# ------------------------------------------------------------------------ listen backlog


def _somaxconn() -> int:
    with open("/proc/sys/net/core/somaxconn") as f:
        return int(f.read())


def test_listen_backlog_defaults_to_2048(env_keyed):
    """Hypercorn's own default (100) reset 7-25% of a 1,024-connection burst."""
    assert listen_backlog(env_keyed.url) == min(2048, _somaxconn())


def test_backlog_flag_sets_the_listen_queue(guarded):
    assert listen_backlog(guarded.url) == 300


def test_backlog_below_one_is_refused(capsys):
    assert main(["--model-path", "/nonexistent", "--backlog", "0"]) == 2
    assert "--backlog" in capsys.readouterr().err
