"""HTTP/2 without TLS (h2c, prior knowledge; issue 28, item 23): a request refused before its
body is read (401, 413) ends that stream only; the other streams on the connection, and later
requests on it, are served."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator

import h2.config
import h2.connection
import h2.events
import pytest

from tests.server.conftest import Server, start_server, stop_server
from tests.server.helpers import PROMPT, sse_payloads

KEY = "secret"
LIMIT = 4096  # --max-request-bytes


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("http2") / "server.log"
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    running = start_server(tiny_model, log, "--max-model-len", "512", "--api-key", KEY,
                           "--max-request-bytes", str(LIMIT), env=env)  # fmt: skip
    yield running
    stop_server(running)


class H2cClient:
    """One HTTP/2 connection, spoken by prior knowledge; each stream's status and body."""

    def __init__(self, server: Server) -> None:
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=60)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.status: dict[int, int] = {}
        self.body: dict[int, bytes] = {}
        self.ended: set[int] = set()
        self.reset: set[int] = set()
        self._flush()

    def _flush(self) -> None:
        self.sock.sendall(self.conn.data_to_send())

    def send_headers(self, path: str, *, auth: bool, length: int) -> int:
        stream = self.conn.get_next_available_stream_id()
        headers = [(":method", "POST"), (":path", path), (":scheme", "http"),
                   (":authority", "localhost"), ("content-type", "application/json"),
                   ("content-length", str(length))]  # fmt: skip
        if auth:
            headers.append(("authorization", f"Bearer {KEY}"))
        self.conn.send_headers(stream, headers)
        self._flush()
        return stream

    def send_data(self, stream: int, data: bytes, end: bool) -> None:
        self.conn.send_data(stream, data, end_stream=end)
        self._flush()

    def post(self, path: str, payload: dict, *, auth: bool = True) -> int:
        data = json.dumps(payload).encode()
        stream = self.send_headers(path, auth=auth, length=len(data))
        self.send_data(stream, data, end=True)
        return stream

    def wait(self, *streams: int) -> None:
        """Read until each of `streams` has ended (a response's end or a reset)."""
        while not set(streams) <= self.ended | self.reset:
            data = self.sock.recv(65536)
            assert data, f"the server closed the connection; streams ended: {self.ended}"
            for event in self.conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    self.status[event.stream_id] = int(dict(event.headers)[b":status"])
                elif isinstance(event, h2.events.DataReceived):
                    self.body[event.stream_id] = self.body.get(event.stream_id, b"") + event.data
                    self.conn.acknowledge_received_data(
                        event.flow_controlled_length, event.stream_id
                    )
                elif isinstance(event, h2.events.StreamEnded):
                    self.ended.add(event.stream_id)
                elif isinstance(event, h2.events.StreamReset):
                    self.reset.add(event.stream_id)
                elif isinstance(event, h2.events.ConnectionTerminated):
                    raise AssertionError(f"the server ended the connection: {event}")
            self._flush()

    def close(self) -> None:
        self.conn.close_connection()
        self._flush()
        self.sock.close()


def test_requests_refused_before_their_body_leave_other_streams_alone(server: Server):
    client = H2cClient(server)
    try:
        long = {"model": server.model, "prompt": PROMPT, "max_tokens": 64, "ignore_eos": True,
                "stream": True}  # fmt: skip
        streaming = client.post("/v1/completions", long)
        # No key: 401 from the headers alone, while the body is still coming.
        unauthorized = client.send_headers("/v1/completions", auth=False, length=3 * LIMIT)
        # Too large: 413 from the declared length, while the body is still coming.
        too_large = client.send_headers("/v1/completions", auth=True, length=3 * LIMIT)
        client.wait(unauthorized, too_large)
        for stream in (unauthorized, too_large):  # the bodies arrive after the answers
            client.send_data(stream, b"x" * LIMIT, end=False)
        assert client.status[unauthorized] == 401
        assert client.status[too_large] == 413

        client.wait(streaming)
        assert client.status[streaming] == 200
        payloads = sse_payloads(client.body[streaming])
        assert "".join(p["choices"][0]["text"] for p in payloads)
        assert payloads[-1]["choices"][0]["finish_reason"] == "length"

        # The connection still serves new requests.
        short = {"model": server.model, "prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}
        later = client.post("/v1/completions", short)
        client.wait(later)
        assert client.status[later] == 200
        assert json.loads(client.body[later])["usage"]["completion_tokens"] == 2
    finally:
        client.close()
