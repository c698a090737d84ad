"""An HTTP/1.1 connection that must deliver each request (headers and body) within a time limit.

uvicorn bounds only the idle time between requests (keep-alive); a client that sends one header
line every few seconds, a body shorter than its Content-Length or a chunked body that never ends
holds its connection (and one of `limit_concurrency`'s places) forever.

    connection made / previous response sent --- read_timeout_s ---> request not fully read? close
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)
_READING = (h11.IDLE, h11.SEND_BODY)  # the client's side of h11's state machine while a request is incomplete


def bounded_http_protocol(read_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol (pass as `uvicorn.Config(http=...)`) closing a connection whose
    request is not completely read `read_timeout_s` after the connection opened or the previous
    response ended."""
    if not read_timeout_s > 0:
        raise ValueError(f"request read timeout={read_timeout_s} s must be > 0")

    class BoundedH11Protocol(_Bounded):
        timeout_s = read_timeout_s

    return BoundedH11Protocol


class _Bounded(H11Protocol):
    timeout_s: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection gets its own time

    def _arm(self) -> None:
        self._disarm()
        self._read_deadline = self.loop.call_later(self.timeout_s, self._on_deadline)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _on_deadline(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing() or self.conn.their_state not in _READING:
            return  # read completely: the request is being answered
        log.info("closing a connection from %s: its request was not read within %.0f s", _peer(self.client), self.timeout_s)
        self.transport.close()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "an unknown peer"
