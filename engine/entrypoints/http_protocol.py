"""uvicorn's h11 protocol with the two limits on slow clients that uvicorn lacks: a request
must arrive in full (headers and body) within `request_read_timeout_s` of its first byte
(of the connection opening, for its first request), and may carry at most
`max_header_count` headers. uvicorn's own limits cover the rest and are passed through its
Config: `timeout_keep_alive` (an idle connection between requests),
`h11_max_incomplete_event_size` (bytes of an unfinished request line and headers) and
`limit_concurrency` (connections + tasks before new requests get 503).

Why here: uvicorn arms no timer while a request is being received (its keep-alive timer
runs only between requests and stops at the next byte), so a client that sends headers and
the first byte of a body, then nothing, holds its connection, its buffers and a slot of
`limit_concurrency` forever. The read timer stops when the request's body is complete:
generation time is bounded by --request-deadline-s instead. On timeout the server answers
408 (nginx's answer to a slow body, `client_body_timeout`) if part of a request came, and
closes. vLLM names: --h11-max-incomplete-event-size, --h11-max-header-count (4 MiB and 256
by default), VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s).
"""

from __future__ import annotations

import logging

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("kvpilot.server")



def closing_response(status: bytes, text: bytes) -> bytes:
    """A whole HTTP/1.1 response (`status` such as b"408 Request Timeout", a plain-text body)
    that tells the client the connection closes: written to the transport directly, outside h11,
    for a request h11 never finished parsing or refused."""
    return (b"HTTP/1.1 %s\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (status, len(text), text))


REQUEST_TIMEOUT_RESPONSE = closing_response(
    b"408 Request Timeout", b"the request did not arrive in full within the server's read timeout")


class _HeaderCountingConnection(h11.Connection):
    """h11's server connection that refuses a request with more than `max_header_count`
    headers (GuardedH11Protocol then answers 431 Request Header Fields Too Large, RFC 6585, and
    closes)."""

    too_many_headers = False

    def __init__(self, max_incomplete_event_size: int, max_header_count: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size)
        self.max_header_count = max_header_count

    def next_event(self):
        event = super().next_event()
        if isinstance(event, h11.Request) and len(event.headers) > self.max_header_count:
            self.too_many_headers = True
            raise h11.RemoteProtocolError(f"more than {self.max_header_count} headers", error_status_hint=431)
        return event


class GuardedH11Protocol(H11Protocol):
    """Configure with `guarded_h11_protocol(...)`; None switches a limit off."""

    request_read_timeout_s: float | None = None
    max_header_count: int | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.max_header_count is not None:
            size = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
            self.conn = _HeaderCountingConnection(size, self.max_header_count)
        self._read_timer = None

    def connection_made(self, transport) -> None:
        """asyncio.Protocol callback: a new connection; starts the read timer."""
        super().connection_made(transport)
        self._arm()  # a connection that never sends a byte is closed too

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 refused: 400, or 431 where it had too many headers."""
        if not getattr(self.conn, "too_many_headers", False):
            super().send_400_response(msg)
            return
        text = f"more than {self.max_header_count} request headers (--h11-max-header-count)".encode()
        self.transport.write(closing_response(b"431 Request Header Fields Too Large", text))
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        """asyncio.Protocol callback: bytes arrived; the read timer runs while a request is partly in."""
        super().data_received(data)
        if self._reading():
            self._arm()  # from the request's first byte; no-op while armed
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        """asyncio.Protocol callback: the connection closed; stops the read timer."""
        self._disarm()
        super().connection_lost(exc)

    def _reading(self) -> bool:
        """Part of a request has arrived and the rest has not: buffered bytes of its
        request line or headers, or its body still coming (h11's view of the client)."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            return True
        # len() of h11's own buffer: `trailing_data` would copy up to 4 MiB on every packet
        buffered = getattr(self.conn, "_receive_buffer", None)
        return state is h11.IDLE and bool(len(buffered) if buffered is not None else self.conn.trailing_data[0])

    def _arm(self) -> None:
        if self.request_read_timeout_s is not None and self._read_timer is None:
            self._read_timer = self.loop.call_later(self.request_read_timeout_s, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self._reading():
            logger.debug("408 to %s: its request did not arrive within %g s", self.client, self.request_read_timeout_s)
            self.transport.write(REQUEST_TIMEOUT_RESPONSE)
            self.transport.close()
        elif self.cycle is None:  # not one byte since the connection opened
            self.transport.close()


def guarded_h11_protocol(request_read_timeout_s: float | None, max_header_count: int | None) -> type[H11Protocol]:
    """The protocol class to pass as uvicorn.Config(http=...)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"request_read_timeout_s": request_read_timeout_s, "max_header_count": max_header_count})
