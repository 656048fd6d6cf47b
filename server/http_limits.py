"""Limits on what a client may send before the app (and the API-key check) sees a request.

uvicorn's httptools protocol reads a request head of any size and any number of header
lines, and keeps a connection that never sends a complete head (or body) open forever:
anyone who can reach the port, key or no key, can make the server hold megabytes per
connection and connections without end. `bounded_http_protocol(limits)` is that protocol
with three bounds, checked as the bytes arrive:

- the request head (request line and headers) over `max_header_bytes`: 431 and close,
  counted as the bytes come in (so at most one socket read beyond the limit is buffered)
  and as the parser hands over each header;
- more than `max_header_count` header lines: 431 and close;
- a head not complete `read_timeout_s` after the connection opened (or after the first
  byte of a keep-alive connection's next request), or a body not complete
  `read_timeout_s` after its head: the connection is closed (408 first, if the client
  sent part of a head; a running request sees a disconnected client).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from server.errors import error_envelope


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_header_bytes: int
    max_header_count: int
    read_timeout_s: float


class _HeadTooLarge(Exception):
    """Raised from a parser callback: stops httptools before the request reaches the app."""


def _error_bytes(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps(error_envelope(message, "invalid_request_error", None, code)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def bounded_http_protocol(limits: HttpLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol class under `limits` (pass it as uvicorn.Config(http=...))."""

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._in_head = True  # reading a request head (not yet its body or a response)
            self._head_bytes = 0
            self._header_count = 0
            self._parsed_head_bytes = 0  # the request line's target and the headers, as parsed
            self._refused: bytes | None = None  # the 431 to send, once a callback found it
            self._read_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_read_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_read_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                # A chunk may also hold the end of the previous body: it counts against the
                # head, a slight over-count that only a head near the limit can notice.
                self._head_bytes += len(data)
            super().data_received(data)
            if self._in_head and self._head_bytes > limits.max_header_bytes and not self.transport.is_closing():
                self._refuse_head(f"the request head exceeds {limits.max_header_bytes} bytes")

        def send_400_response(self, msg: str) -> None:
            # uvicorn's answer to a parser error, which a callback's _HeadTooLarge also is.
            if self._refused is not None:
                self._cancel_read_timer()
                self.transport.write(self._refused)
                self.transport.close()
                return
            super().send_400_response(msg)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._header_count = 0
            self._parsed_head_bytes = 0
            self._arm_read_timer()

        def on_url(self, url: bytes) -> None:
            self._parsed_head_bytes += len(url)
            self._check_parsed_head()
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_count += 1
            self._parsed_head_bytes += len(name) + len(value) + 4  # ": " and CRLF
            if self._header_count > limits.max_header_count:
                self._refused = _error_bytes(
                    431, "Request Header Fields Too Large",
                    f"the request has more than {limits.max_header_count} header lines", "header_fields_too_large")
                raise _HeadTooLarge
            self._check_parsed_head()
            super().on_header(name, value)

        def _check_parsed_head(self) -> None:
            # A head that came in one socket read is parsed whole before data_received can
            # count it: the parsed parts are counted as they come.
            if self._parsed_head_bytes > limits.max_header_bytes:
                self._refused = _error_bytes(
                    431, "Request Header Fields Too Large",
                    f"the request head exceeds {limits.max_header_bytes} bytes", "header_fields_too_large")
                raise _HeadTooLarge

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._arm_read_timer()  # now for the body
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._cancel_read_timer()
            self._in_head = True  # the bytes from here on are the next request's head
            self._head_bytes = 0
            super().on_message_complete()

        def _refuse_head(self, message: str) -> None:
            self._refused = _error_bytes(431, "Request Header Fields Too Large", message, "header_fields_too_large")
            self.send_400_response(message)

        def _arm_read_timer(self) -> None:
            self._cancel_read_timer()
            self._read_timer = self.loop.call_later(limits.read_timeout_s, self._read_timed_out)

        def _cancel_read_timer(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if self.transport.is_closing():
                return
            if self._in_head and self._head_bytes:
                self.transport.write(_error_bytes(
                    408, "Request Timeout",
                    f"the request head was not complete within {limits.read_timeout_s:g} s", "request_timeout"))
            self.transport.close()

    return BoundedHttpToolsProtocol
