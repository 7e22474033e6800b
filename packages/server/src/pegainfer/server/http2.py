"""HTTP/2 as hypercorn serves it (h2c: cleartext, by prior knowledge or `Upgrade`), with the
one fix a multiplexed API server needs.

A server may answer a request before reading its body (RFC 9113, section 8.1): ours does for
a bad API key (401), a body over `--max-request-bytes` (413) and unknown routes (404). The
client's DATA frames for that stream may still be in flight; hypercorn 0.18 looks them up
among its open streams without a guard, and the `KeyError` ends the whole connection, cutting
every other stream on it (upstream: pgjones/hypercorn#329, fixes proposed in #312 and #334,
not released). `_H2Protocol` drops such frames instead, returns their flow-control credit to
the connection (else the connection's window shrinks until nothing more can be sent on it),
and asks the client to stop sending that body (RST_STREAM with NO_ERROR, as the RFC suggests
after a complete response). HTTP/1.1 is untouched.
"""

from __future__ import annotations

import contextlib

import h2.errors
import h2.events
import h2.exceptions
import hypercorn.protocol
from hypercorn.protocol.h2 import H2Protocol


class _H2Protocol(H2Protocol):
    async def _handle_events(self, events: list[h2.events.Event]) -> None:
        pending: list[h2.events.Event] = []
        for event in events:
            if not isinstance(event, h2.events.DataReceived):
                pending.append(event)
                continue
            # The events before it may open or close its stream: handle them first.
            await super()._handle_events(pending)
            pending = []
            if event.stream_id in self.streams:
                await super()._handle_events([event])
            else:
                self._discard(event)
        await super()._handle_events(pending)

    def _discard(self, event: h2.events.DataReceived) -> None:
        """Data for a stream already answered: give the window back, stop the sender."""
        self.connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        # Closed on both sides already (StreamClosedError): nothing more will come.
        with contextlib.suppress(h2.exceptions.StreamClosedError):
            self.connection.reset_stream(event.stream_id, h2.errors.ErrorCodes.NO_ERROR)


def install() -> None:
    """Serve HTTP/2 connections with `_H2Protocol` (hypercorn picks the class by this name
    for each connection that speaks HTTP/2)."""
    hypercorn.protocol.H2Protocol = _H2Protocol  # type: ignore[misc]
